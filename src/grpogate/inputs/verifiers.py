"""Rule verifiers: a completion and a reference answer in, a binary reward out.

Pure Python (no torch), so the reward rule can be audited and tested on its own. Every verifier
has a stable `.version` (recorded on each trajectory and checked by the rollout contract), an
`.error_count` (exceptions caught while scoring; the run records it as `verifier_errors`) and
`.score(completion, reference)`, which returns exactly 1.0 or 0.0 and never raises.

>>> v = get_verifier("gsm8k-final-number-v1")
>>> v.version
'gsm8k-final-number-v1'
>>> v.score("She pays $1,000.00 in total.", "500 + 500 = 1000\\n#### 1000")
1.0
>>> v.score("Maybe 18, but I think 17.", "#### 18")
0.0
>>> v.score(None, "#### 18")
0.0
>>> last_number("It costs $18/day, so -2.50 is left.")
Decimal('-2.50')
>>> extract_final_answer("3 + 4 = 7\\nanswer:  7 \\nthanks")
'7'
>>> plain_number("$1,234.50."), plain_number("1,2,3")
('1234.50', None)
>>> get_verifier("exact-answer-v1").score("so\\nAnswer:  Paris \\n", " Paris")
1.0
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any, Protocol

GSM8K_FINAL_NUMBER = "gsm8k-final-number-v1"
MATH_VERIFY = "math-verify-v1"
EXACT_ANSWER = "exact-answer-v1"
REASONING_GYM_PREFIX = "reasoning-gym/"
KNOWN_VERIFIERS = (GSM8K_FINAL_NUMBER, MATH_VERIFY, EXACT_ANSWER,
                   REASONING_GYM_PREFIX + "<dataset_name>")

# A number as people write it in answers: an optional sign, an optional "$", digits with
# optional thousands separators (groups of exactly three) and an optional decimal part, or a
# bare ".5". The sign counts only when it does not follow a word character or a dot, so
# "10-5" reads as 10 and 5, not 10 and -5. A trailing "." is not part of the number ("18.").
# Each repetition runs over a fixed character class with no nested ambiguity, so a scan is
# linear in the text (a 1 MB completion takes milliseconds, not forever).
_NUMBER = re.compile(
    r"(?:(?<![\w.])(?P<sign>[-+]))?\$?"
    r"(?P<magnitude>(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)",
    re.ASCII,
)
_ANSWER_MARKER = re.compile(r"answer:", re.ASCII | re.IGNORECASE)
# reasoning-gym datasets whose score_answer runs the model's answer through eval() or
# sympy.parse_expr (which calls eval): scoring would execute model output as Python. Found by
# reading every scorer of reasoning-gym 0.1.25; tests/test_verifiers.py re-scans the installed
# version so that an upgrade adding another one fails the tests. "composite" delegates to
# other datasets' scorers, which cannot be checked here.
CODE_EVALUATING_SCORERS = frozenset({
    "binary_matrix", "countdown", "intermediate_integration", "n_queens",
    "polynomial_multiplication", "puzzle24", "simple_integration", "spiral_matrix",
    "string_insertion", "composite"})


def _number_text(match: re.Match[str]) -> str:
    """The matched number as plain decimal text: sign kept, "$" and separators dropped."""
    return (match.group("sign") or "") + match.group("magnitude").replace(",", "")


def _last_number_match(text: str) -> re.Match[str] | None:
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return last


def last_number(text: Any) -> Decimal | None:
    """The last number written in `text` as an exact Decimal, or None when there is none."""
    if not isinstance(text, str):
        return None
    match = _last_number_match(text)
    return None if match is None else Decimal(_number_text(match))


def reference_number(reference: Any) -> Decimal | None:
    """The number after the last "####" of a GSM8K answer; without "####", of the whole text."""
    if not isinstance(reference, str):
        return None
    _, _, final_part = reference.rpartition("####")  # no "####": final_part is the whole text
    match = _NUMBER.search(final_part)
    return None if match is None else Decimal(_number_text(match))


def plain_number(text: str) -> str | None:
    """The plain decimal text of a string that is exactly one number as people write it
    (optional sign, "$", thousands separators, one trailing period), e.g. "$1,000.00." ->
    "1000.00"; None otherwise."""
    candidate = text.strip()
    if candidate.endswith("."):
        candidate = candidate[:-1]
    match = _NUMBER.fullmatch(candidate)
    return None if match is None else _number_text(match)


def extract_final_answer(completion: Any) -> str | None:
    """The model's final answer: the rest of the line after the last "Answer:" (any case),
    stripped; without "Answer:", the last number in the completion; None when neither exists."""
    if not isinstance(completion, str):
        return None
    marker = None
    for marker in _ANSWER_MARKER.finditer(completion):
        pass
    if marker is not None:
        line_end = completion.find("\n", marker.end())
        return completion[marker.end() : None if line_end < 0 else line_end].strip()
    match = _last_number_match(completion)
    return None if match is None else _number_text(match)


class Verifier(Protocol):
    name: str
    version: str
    error_count: int

    def score(self, completion: Any, reference: Any) -> float: ...


class FinalNumberVerifier:
    """GSM8K rule: the last number of the completion equals the reference's `#### N`.

    Values are compared as exact Decimals ("18.00" == "18", "0.5" == ".5"); nothing is
    evaluated, and no float tolerance is needed because both sides are parsed from text.
    """

    name = GSM8K_FINAL_NUMBER
    version = GSM8K_FINAL_NUMBER

    def __init__(self) -> None:
        self.error_count = 0

    def score(self, completion: Any, reference: Any) -> float:
        try:
            expected = reference_number(reference)
            answered = last_number(completion)
        except Exception:  # parsing plain text should not fail; if it does, count it
            self.error_count += 1
            return 0.0
        if expected is None or answered is None:
            return 0.0
        return 1.0 if answered == expected else 0.0


class ExactAnswerVerifier:
    """A dataset's `task.verifier = "exact"`: the completion's final answer
    (`extract_final_answer`: the rest of the line after the last "Answer:", else the last
    number) equals the reference, character for character once leading and trailing whitespace
    is stripped from both. Nothing is parsed or normalized (no numbers, no case)."""

    name = EXACT_ANSWER
    version = EXACT_ANSWER

    def __init__(self) -> None:
        self.error_count = 0

    def score(self, completion: Any, reference: Any) -> float:
        answer = extract_final_answer(completion)
        if answer is None or not isinstance(reference, str):
            return 0.0
        return 1.0 if answer.strip() == reference.strip() else 0.0


class ReasoningGymVerifier:
    """A reasoning-gym dataset's own scorer, applied to the completion's final answer.

    reasoning-gym scorers give partial credit (e.g. 0.01 for a badly formatted answer, or
    len(answer)/len(text) when the answer is a substring); GRPO rewards here are binary, so only
    an exact 1.0 counts as correct. The scorer is third-party code: any exception it raises is
    caught, counted in `error_count` and scored 0.0, so one odd completion cannot stop a run.
    """

    def __init__(self, dataset_name: str) -> None:
        try:  # lazy: keeps `import grpogate.inputs.verifiers` cheap and dependency-free
            import reasoning_gym
            from reasoning_gym.factory import DATASETS
        except ImportError as error:  # the scorer is reasoning-gym's own: nothing to fall back on
            raise ValueError(f"verifier '{REASONING_GYM_PREFIX}{dataset_name}' needs the "
                             f"reasoning-gym package, which cannot be imported ({error}): "
                             "pip install reasoning-gym") from None

        if dataset_name not in DATASETS:
            raise ValueError(
                f"unknown reasoning-gym dataset {dataset_name!r} in verifier "
                f"'{REASONING_GYM_PREFIX}{dataset_name}'; reasoning-gym knows "
                f"{len(DATASETS)} datasets, e.g. {', '.join(sorted(DATASETS)[:5])}"
            )
        if dataset_name in CODE_EVALUATING_SCORERS:
            raise ValueError(
                f"reasoning-gym dataset {dataset_name!r} is refused as a verifier: its scorer "
                "evaluates the model's answer as code (eval / sympy.parse_expr), and grpogate "
                "never executes model output"
            )
        try:
            # One small instance is enough: only its score_answer method is used.
            self._dataset = reasoning_gym.create_dataset(dataset_name, size=1, seed=0)
        except Exception as error:
            raise ValueError(
                f"could not create reasoning-gym dataset {dataset_name!r}: {error}"
            ) from error
        self.name = REASONING_GYM_PREFIX + dataset_name
        # `.version` must stay stable across library upgrades (it is part of every trajectory's
        # identity); the library version is recorded next to it as evidence. v2: an answer that
        # is one number as people write it is handed to the scorer as the plain number.
        self.version = f"{self.name}-v2"
        self.library_version = _distribution_version("reasoning-gym", reasoning_gym)
        self.error_count = 0

    def score(self, completion: Any, reference: Any) -> float:
        if not isinstance(reference, str):
            return 0.0
        answer = extract_final_answer(completion)
        if answer is None:  # nothing to grade; not a scorer error
            return 0.0
        # "$1,000.00." means 1000.00 to a reader, but reasoning-gym's decimal scorers reject the
        # "$" and the sentence's period; only when both sides are plain numbers is it rewritten.
        plain = plain_number(answer)
        if plain is not None and plain_number(reference) is not None:
            answer = plain
        try:
            reward = float(self._dataset.score_answer(answer, {"answer": reference, "metadata": {}}))
        except Exception:
            self.error_count += 1
            return 0.0
        return 1.0 if reward >= 1.0 else 0.0  # NaN compares False -> 0.0


class MathVerifyVerifier:
    """Hugging Face math-verify (`\\boxed{}`, LaTeX, fractions, percentages) against the
    reference's final answer (after its last "####", else the whole reference).

    math-verify can evaluate model output as code (sympy's parse_expr calls eval), so it runs
    only in a confined child process (inputs/math_verify_worker.py: no root, no new processes,
    no file writes, bounded memory) and each completion gets `time_limit_seconds` of wall clock;
    past it the child is killed and restarted. A timeout, a crash or a completion over
    MAX_CHARS (never sent) scores 0.0 and counts in `error_count`.
    """

    name = MATH_VERIFY
    # `name` is what a config says; `version` changes with what the verifier does. v2: a bare
    # LaTeX reference (no `$`) is read wrapped in `$...$` (math_verify_worker.gold_text); v1
    # read it as text, so a run scored by v1 re-scores differently, and the audit names it.
    version = "math-verify-v2"
    MAX_CHARS = 20_000  # about 5,000 tokens: longer than any budget here; a 1 MB string is refused
    STARTUP_SECONDS = 120.0  # importing sympy on a busy 2-core machine

    def __init__(self, time_limit_seconds: float = 5.0) -> None:
        from importlib import util

        if util.find_spec("math_verify") is None:
            raise ValueError("verifier 'math-verify-v1' needs the math-verify package: "
                             "pip install 'grpogate[math]'")
        self.time_limit_seconds = time_limit_seconds
        self.error_count = 0
        self._child = None
        self.library_version = None

    def _start(self):
        import subprocess
        import sys
        from pathlib import Path

        worker = Path(__file__).with_name("math_verify_worker.py")
        # -I: no PYTHONPATH, no user site, not the current directory: only the worker's code.
        self._child = subprocess.Popen([sys.executable, "-I", str(worker)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                       text=True, bufsize=1)
        ready = self._reply(self.STARTUP_SECONDS)
        if ready is None or "ready" not in ready:
            self.close()
            raise RuntimeError("the math-verify worker did not start")
        self.library_version = ready["ready"]

    def _reply(self, seconds: float) -> dict | None:
        import json
        import select

        readable, _, _ = select.select([self._child.stdout], [], [], seconds)
        line = self._child.stdout.readline() if readable else ""
        try:
            return json.loads(line) if line else None
        except ValueError:
            return None

    def close(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None

    def __del__(self) -> None:
        self.close()

    def score(self, completion: Any, reference: Any) -> float:
        if not isinstance(completion, str) or not isinstance(reference, str):
            return 0.0
        if len(completion) > self.MAX_CHARS:
            self.error_count += 1
            return 0.0
        reply = self._ask({"completion": completion, "gold": self.gold(reference)})
        if reply is None:
            self.error_count += 1
            return 0.0
        if reply.get("error"):
            self.error_count += 1
        return 1.0 if reply.get("reward") == 1.0 else 0.0

    @staticmethod
    def gold(reference: str) -> str:
        """The reference's final answer: after its last "####", else the whole reference."""
        return reference.rpartition("####")[2].strip()

    def readable(self, reference: str) -> bool:
        """Whether math-verify reads `reference` as math (bare LaTeX wrapped in $...$ first, as
        scoring does); False also when the check fails or runs past the time limit."""
        if not isinstance(reference, str) or len(reference) > self.MAX_CHARS:
            return False
        reply = self._ask({"gold": self.gold(reference)})
        return bool(reply and reply.get("readable") is True)

    def _ask(self, request: dict) -> dict | None:
        """One request to the sandboxed child; None past the time limit or when it died (a
        fresh child is started next time)."""
        import json

        try:
            if self._child is None:
                self._start()
            self._child.stdin.write(json.dumps(request) + "\n")
            reply = self._reply(self.time_limit_seconds)
        except (OSError, RuntimeError, ValueError):
            reply = None
        if reply is None:
            self.close()
        return reply


def _distribution_version(distribution: str, module: Any) -> str:
    # The installed distribution's metadata is authoritative; reasoning_gym.__version__ has
    # lagged behind the released package.
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "unknown"))


def check_references(verifier: Verifier, problems: list) -> None:
    """Admission: a verifier that can fail to read a reference (math-verify) must read every one,
    or each answer to that problem would score 0 and the run would train on a wrong reward.
    InputError naming the problem's file and line (its `source`) and the field."""
    readable = getattr(verifier, "readable", None)
    if readable is None:
        return
    for problem in problems:
        if not readable(problem.reference):
            from grpogate.errors import InputError

            raise InputError(f"{problem.source}: field \"answer\": {verifier.name} cannot "
                             f"read the reference answer {problem.reference[-80:]!r} as math "
                             "(not even as $...$ LaTeX); fix it, or choose another verifier")


def get_verifier(name: str) -> Verifier:
    """The verifier called `name`: "gsm8k-final-number-v1", "math-verify-v1",
    "exact-answer-v1" or "reasoning-gym/<dataset_name>"."""
    if name == GSM8K_FINAL_NUMBER:
        return FinalNumberVerifier()
    if name == EXACT_ANSWER:
        return ExactAnswerVerifier()
    if name == MATH_VERIFY:
        return MathVerifyVerifier()
    if isinstance(name, str) and name.startswith(REASONING_GYM_PREFIX):
        dataset_name = name[len(REASONING_GYM_PREFIX) :]
        if dataset_name:
            return ReasoningGymVerifier(dataset_name)
    raise ValueError(f"unknown verifier {name!r}; known verifiers: {', '.join(KNOWN_VERIFIERS)}")
