"""Verifiers: the GSM8K final-number rule, reasoning-gym scorers, and that neither ever raises."""

import doctest
import inspect
import re
import subprocess
import sys
import time
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import grpogate.inputs.verifiers as verifiers
from grpogate.inputs.verifiers import extract_final_answer, get_verifier, last_number, reference_number

GSM8K = "gsm8k-final-number-v1"


@pytest.fixture(scope="module")
def gsm8k():
    return get_verifier(GSM8K)


@pytest.fixture(scope="module")
def chain_sum():
    return get_verifier("reasoning-gym/chain_sum")


# (completion, reference, expected reward), each worked out by reading the text.
GSM8K_TABLE = [
    ("The total is 1,000 dollars.", "#### 1000", 1.0),  # thousands separator
    ("The total is 1000.", "#### 1,000", 1.0),  # separator on the reference side
    ("She earns $18 a day.", "#### 18", 1.0),  # dollar sign
    ("So the answer is 18.", "#### 18", 1.0),  # trailing period
    ("It costs 18.00", "#### 18", 1.0),  # equal decimal value
    ("Half is 0.5", "#### .5", 1.0),
    ("Half is .5", "#### 0.5", 1.0),
    ("It drops to -5", "#### -5", 1.0),  # negative
    ("It drops to -5", "#### 5", 0.0),
    ("A change of +5", "#### 5", 1.0),
    ("She makes $18/day", "#### 18", 1.0),  # number glued to text
    ("Cost: $1,234,567.50!", "#### 1234567.5", 1.0),
    ("I do not know.", "#### 18", 0.0),  # no number
    ("", "#### 18", 0.0),
    ("First 18, then 17", "#### 18", 0.0),  # last number wins
    ("First 17, then 18", "#### 18", 1.0),
    ("10-8 is 2", "#### 2", 1.0),
    ("10-8", "#### 8", 1.0),  # a minus after a digit is subtraction, not a sign
    ("18", "Natalia sold 48/2 = 24 clips.\n48+24 = 72\n#### 72", 0.0),  # only #### counts
    ("72", "Natalia sold 48/2 = 24 clips.\n48+24 = 72\n#### 72", 1.0),
    ("72", "72", 1.0),  # no ####: the whole reference is the number
    ("72", "  72\n", 1.0),
    ("72", "no number here", 0.0),
    ("72", "#### ", 0.0),
    ("18.5", "#### 18", 0.0),  # exact values, no tolerance
    ("0.30000000000000004", "#### 0.3", 0.0),
]


@pytest.mark.parametrize("completion, reference, expected", GSM8K_TABLE)
def test_gsm8k_table(gsm8k, completion, reference, expected):
    assert gsm8k.score(completion, reference) == expected


@pytest.mark.parametrize("completion", [None, 18, 18.0, b"18", ["18"], object()])
def test_gsm8k_non_str_completion_scores_zero(gsm8k, completion):
    assert gsm8k.score(completion, "#### 18") == 0.0


def test_gsm8k_non_str_reference_scores_zero(gsm8k):
    assert gsm8k.score("18", None) == 0.0
    assert gsm8k.score("18", 18) == 0.0


def test_gsm8k_identity():
    verifier = get_verifier(GSM8K)
    assert verifier.version == GSM8K
    assert verifier.name == GSM8K
    assert verifier.error_count == 0
    assert get_verifier(GSM8K) is not verifier  # each run counts its own errors


def test_number_helpers():
    assert last_number("a 1,000 b 2,500.75 c") == Decimal("2500.75")
    assert last_number("none") is None
    assert last_number(None) is None
    assert reference_number("steps 3 + 4 = 7\n#### 7") == Decimal(7)
    assert reference_number("#### -1,200") == Decimal(-1200)


def test_unknown_verifier_names_the_known_ones():
    for name in ["gsm8k", "", "reasoning-gym/", None]:
        with pytest.raises(ValueError) as error:
            get_verifier(name)
        assert GSM8K in str(error.value)
        assert "reasoning-gym/<dataset_name>" in str(error.value)


def test_a_megabyte_completion_scores_quickly(gsm8k):
    # Inputs shaped to trip backtracking: long separator runs, digit runs, sign/dollar runs.
    adversarial = [
        "1" + ",000" * 250_000 + "0",
        "9" * 1_000_000,
        "-$" * 500_000,
        "1,0001," * 150_000,
        "Answer:" * 150_000,
        ". " * 500_000 + "18",
    ]
    for completion in adversarial:
        started = time.perf_counter()
        gsm8k.score(completion, "#### 18")
        extract_final_answer(completion)
        assert time.perf_counter() - started < 2.0
    assert gsm8k.score(". " * 500_000 + "18", "#### 18") == 1.0


# --- reasoning-gym --------------------------------------------------------------------------

def test_reasoning_gym_identity(chain_sum):
    import reasoning_gym  # noqa: F401  (already imported by the verifier)

    assert chain_sum.name == "reasoning-gym/chain_sum"
    assert chain_sum.version == "reasoning-gym/chain_sum-v2"
    assert isinstance(chain_sum.library_version, str) and chain_sum.library_version
    assert chain_sum.error_count == 0


def test_reasoning_gym_scores_a_real_chain_sum_item(chain_sum):
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(
        "chain_sum", size=3, seed=1, min_terms=2, max_terms=2, min_digits=1, max_digits=2
    )
    for item in dataset:
        answer = item["answer"]
        wrong = str(int(answer) + 1)
        assert chain_sum.score(f"Let me add them up.\nAnswer: {answer}", answer) == 1.0
        assert chain_sum.score(f"Let me add them up.\nanswer: {wrong}", answer) == 0.0
        assert chain_sum.score(f"I think {wrong}... no, {answer}", answer) == 1.0  # last number
    assert chain_sum.error_count == 0


def test_reasoning_gym_answer_extraction(chain_sum):
    # The last "Answer:" line wins, and only up to the end of that line.
    assert chain_sum.score("Answer: 3\nWait.\nANSWER: 7 \nDone, 3.", "7") == 1.0
    assert chain_sum.score("Answer: 7\nANSWER: 3\n", "7") == 0.0
    # Partial credit (reasoning-gym gives len(answer)/len(text) here) is not a reward.
    assert chain_sum.score("Answer: 7 apples", "7") == 0.0
    assert chain_sum.score("no answer here", "7") == 0.0
    assert chain_sum.score(None, "7") == 0.0
    assert chain_sum.score("Answer: 7", None) == 0.0
    assert extract_final_answer("x\nAnswer:\n7") == ""
    assert extract_final_answer("costs $1,000.") == "1000"
    assert extract_final_answer(None) is None


def test_reasoning_gym_scorer_errors_are_counted(monkeypatch):
    verifier = get_verifier("reasoning-gym/chain_sum")

    def broken_scorer(answer, entry):
        raise RuntimeError("scorer bug")

    monkeypatch.setattr(verifier._dataset, "score_answer", broken_scorer)
    assert verifier.score("Answer: 7", "7") == 0.0
    assert verifier.score("Answer: 8", "7") == 0.0
    assert verifier.error_count == 2
    monkeypatch.setattr(verifier._dataset, "score_answer", lambda answer, entry: float("nan"))
    assert verifier.score("Answer: 7", "7") == 0.0
    assert verifier.error_count == 2


def test_unknown_reasoning_gym_dataset():
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset 'no_such_dataset'"):
        get_verifier("reasoning-gym/no_such_dataset")


# --- safety: model output is text, never code ---------------------------------------------------

# A scorer that calls one of these on its input runs that input as Python.
_CODE_EVALUATION = re.compile(r"(?<![\w.])eval\(|parse_expr\(|sympify\(|(?<![\w.])exec\(|"
                              r"parse_latex\(")
# Scorers that evaluate only the reference answer (generated by reasoning-gym itself).
_EVALUATES_ONLY_THE_REFERENCE = {"number_sorting"}


@pytest.mark.parametrize("name", ["countdown", "puzzle24", "n_queens", "composite"])
def test_scorers_that_evaluate_the_answer_are_refused(name):
    with pytest.raises(ValueError, match="evaluates the model's answer as code"):
        get_verifier(f"reasoning-gym/{name}")


def test_every_code_evaluating_scorer_of_the_installed_reasoning_gym_is_refused():
    """Re-scan the installed reasoning-gym: an upgrade that adds such a scorer fails here."""
    from reasoning_gym.factory import DATASETS

    evaluating = set()
    for name, (dataset_class, _) in DATASETS.items():
        try:
            source = inspect.getsource(dataset_class.score_answer)
        except (OSError, TypeError):
            continue
        if _CODE_EVALUATION.search(source):
            evaluating.add(name)
    assert evaluating - _EVALUATES_ONLY_THE_REFERENCE <= verifiers.CODE_EVALUATING_SCORERS
    assert "chain_sum" not in verifiers.CODE_EVALUATING_SCORERS



# --- properties -----------------------------------------------------------------------------

junk_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=200) | st.text(
    alphabet="0123456789,.$-+ #Answer:\n", max_size=60
)


@settings(max_examples=300, deadline=None)
@given(completion=junk_text, reference=junk_text)
def test_gsm8k_never_raises_and_is_deterministic(gsm8k, completion, reference):
    first = gsm8k.score(completion, reference)
    assert first in (0.0, 1.0)
    assert gsm8k.score(completion, reference) == first
    assert gsm8k.error_count == 0


@settings(max_examples=150, deadline=None)
@given(completion=junk_text, reference=junk_text)
def test_reasoning_gym_never_raises_and_is_deterministic(chain_sum, completion, reference):
    first = chain_sum.score(completion, reference)
    assert first in (0.0, 1.0)
    assert chain_sum.score(completion, reference) == first


def _with_separators(value: int) -> str:
    return f"{value:,}"


@settings(max_examples=200, deadline=None)
@given(
    value=st.integers(min_value=-10**12, max_value=10**12),
    prefix=st.sampled_from(["", "The answer is ", "so x = ", "Total:\n"]),
)
def test_written_forms_of_a_number_score_like_the_plain_number(gsm8k, value, prefix):
    plain = str(value)
    sign, digits = ("-", plain[1:]) if value < 0 else ("", plain)
    forms = [
        prefix + plain,
        prefix + _with_separators(value),
        prefix + f"{sign}${digits}",
        prefix + plain + ".",
        prefix + plain + ".00",
        prefix + f"{sign}${_with_separators(abs(value))}.00.",
    ]
    for reference in [f"#### {plain}", f"#### {_with_separators(value)}", plain]:
        assert [gsm8k.score(form, reference) for form in forms] == [1.0] * len(forms)
    assert gsm8k.score(prefix + str(value + 1), f"#### {plain}") == 0.0


def _written_forms(value: Decimal) -> list[str]:
    """How people write `value` (at most two decimals): thousands separators, "$", a sentence's
    trailing period, trailing zeros (".00" for a whole number), and their combinations."""
    sign = "-" if value < 0 else ""
    two = f"{abs(value):.2f}"  # "1234.50", "7.00"
    whole, cents = two.split(".")
    grouped = f"{int(whole):,}.{cents}"
    return [sign + two, sign + grouped, f"{sign}${grouped}", f"{sign}{two}.", f"{sign}${grouped}.",
            f"{sign}{abs(value):.4f}"]


@settings(max_examples=200, deadline=None)
@given(cents=st.integers(min_value=-10**9, max_value=10**9))
def test_decimal_forms_score_like_the_plain_decimal(gsm8k, cents):
    value = Decimal(cents).scaleb(-2)  # e.g. 1234.50
    plain = format(value.normalize(), "f")
    sign = "-" if value < 0 else ""
    references = [f"#### {plain}", f"#### {sign}${int(abs(value)):,}.{f'{abs(value):.2f}'[-2:]}"]
    for reference in references:
        for form in _written_forms(value):
            assert gsm8k.score(f"So it is {form}", reference) == 1.0, (form, reference)
        assert gsm8k.score(f"So it is {value + 1}", reference) == 0.0


@settings(max_examples=150, deadline=None)
@given(value=st.integers(min_value=-10**9, max_value=10**9),
       prefix=st.sampled_from(["Answer: ", "The sum is done.\nanswer:  ", "ANSWER:"]))
def test_reasoning_gym_reads_written_forms_as_the_plain_number(chain_sum, value, prefix):
    reference = str(value)  # reasoning-gym's chain_sum answers are plain integers
    for form in _written_forms(Decimal(value)) + [f"{value:,}", f"{value}."]:
        assert chain_sum.score(prefix + form, reference) == 1.0, form
    assert chain_sum.score(prefix + str(value + 1), reference) == 0.0
    assert chain_sum.error_count == 0


def test_doctests():
    assert doctest.testmod(verifiers).failed == 0


def test_importing_verifiers_does_not_import_torch():
    code = (
        "import sys, grpogate.inputs.verifiers, grpogate.evidence.decisions\n"
        "assert 'torch' not in sys.modules, 'import'\n"
        "assert 'reasoning_gym' not in sys.modules, 'lazy'\n"
        "grpogate.inputs.verifiers.get_verifier('reasoning-gym/chain_sum')\n"
        "assert 'torch' not in sys.modules, 'reasoning-gym verifier'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
