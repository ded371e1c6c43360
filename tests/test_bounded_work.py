"""Work and memory bounded by the number of entries a stranger's file holds, never by the values
in them; and every bad value one `error:` line (exit 2) or the API's InputError, found before
anything is written.

Huge or hostile inputs run their subject in a fresh interpreter under a 2 GiB address-space
cap and a timeout, so a regression fails the test instead of exhausting the machine. Every
expected figure is computed by hand beside it.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from synthetic_run import write_synthetic_run
from test_trainer_log import SETTINGS, adapter_dir, entry, trainer_state

import grpogate
from grpogate.errors import InputError
from grpogate.files import parse_json

SRC = Path(__file__).resolve().parents[1] / "src"
GiB = 1 << 30
LIMIT = "over the limit of 4194304 for a string in a file grpogate reads; not what grpogate writes"


def capped(*command: str, cap: int = 2 * GiB, timeout: int = 120) -> subprocess.CompletedProcess:
    """`command` (argv after the interpreter) under RLIMIT_AS = `cap` bytes and `timeout`."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200"}
    return subprocess.run([sys.executable, *command], capture_output=True, text=True,
                          timeout=timeout, env=env, preexec_fn=limit)


def grpogate_cli(*args, cap: int = 2 * GiB, timeout: int = 120) -> subprocess.CompletedProcess:
    return capped("-m", "grpogate", *map(str, args), cap=cap, timeout=timeout)


def one_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    # stderr: the one error line (libraries may log there before it); stdout: nothing.
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    assert result.stdout.strip() == "", result.stdout[-2000:]
    return lines[0]


# The child's peak resident set, as its parent sees it when it is reaped (KiB on Linux).
PEAK = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:], "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode; "
        "print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def peak_bytes(*args) -> tuple[int, int]:
    """(exit code, peak RSS in bytes) of `grpogate ARGS`, capped as `capped` caps."""
    result = capped("-c", PEAK, sys.executable, "-m", "grpogate", *map(str, args))
    code, kib = map(int, result.stdout.split())
    return code, kib * 1024


def with_evidence(source: Path, target: Path, change) -> Path:
    """A copy of the run `source` whose evidence.json is changed by `change` (in place)."""
    run = Path(shutil.copytree(source, target))
    evidence = json.loads((run / "evidence.json").read_text())
    change(evidence)
    (run / "evidence.json").write_text(json.dumps(evidence, indent=2))
    return run


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_synthetic_run(tmp_path_factory.mktemp("pristine"))


# --- item 2: a long JSON string costs memory in proportion to the file ------------------------

def test_a_200_mb_string_in_evidence_is_refused_under_a_2_gib_cap(pristine, tmp_path):
    # The depth check's regex held ~120 bytes a character: 200 MB took 24 GB (MemoryError here).
    run = with_evidence(pristine, tmp_path / "run", lambda e: e.update(run_label="x" * 200_000_000))
    field = 'field "run_label": a string of 200000000 characters, ' + LIMIT
    assert one_error(grpogate_cli("decide", run)) == f"error: evidence.json: {field}"
    assert one_error(grpogate_cli("report", run)) == f"error: {run}/evidence.json: {field}"
    assert not (run / "report.html").exists()


def with_raw_evidence(source: Path, target: Path, change) -> Path:
    """`with_evidence`, written as UTF-8 (ensure_ascii=False) the way another writer may."""
    run = Path(shutil.copytree(source, target))
    evidence = json.loads((run / "evidence.json").read_text())
    change(evidence)
    (run / "evidence.json").write_text(json.dumps(evidence, ensure_ascii=False), "utf-8")
    return run


def test_decide_and_report_peak_memory_is_under_4x_a_17_mb_file(pristine, tmp_path):
    """Peak RSS over the same command's on the pristine run, per byte of evidence.json: at most
    4 (measured 1.7-3.4; the old code took 2.1 GB for the refused file, 125x, and 5.8x for the
    file whose one emoji made Python hold its whole text at 4 bytes a character)."""
    refused = with_evidence(pristine, tmp_path / "refused",
                            lambda e: e.update(run_label="x" * 17_000_000))
    # 17 strings of 1,000,000 characters each: under the 4 MiB field limit, so parsed whole.
    accepted = with_evidence(pristine, tmp_path / "accepted",
                             lambda e: e.update(extra=["x" * 1_000_000] * 17))
    # The same written raw with one character above U+FFFF, and one above U+00FF.
    wide = [with_raw_evidence(pristine, tmp_path / name, lambda e, c=character: e.update(
        extra=["x" * 1_000_000] * 16 + ["x" * 999_999 + c])) for name, character in (
            ("astral", "\U0001F600"), ("bmp", "\u4e2d"))]
    for command in ("decide", "report"):
        code, baseline = peak_bytes(command, Path(shutil.copytree(pristine, tmp_path / command)))
        assert code == 0
        parsed = {"decide": 4, "report": 0}[command]
        for run, expected in ((refused, 2), (accepted, parsed), *((w, parsed) for w in wide)):
            size = (run / "evidence.json").stat().st_size
            assert size > 17_000_000
            code, peak = peak_bytes(command, run)
            assert code == expected, (command, run.name)
            assert peak - baseline <= 4 * size, (command, run.name, peak, baseline, size)


def test_a_string_at_the_field_limit_parses_and_one_past_it_is_refused_naming_the_field():
    from grpogate.files import MAX_JSON_STRING_CHARS

    # MAX_JSON_STRING_CHARS = 2**22 = 4,194,304 characters between the quotes.
    assert MAX_JSON_STRING_CHARS == 4_194_304
    at_limit = "a" * MAX_JSON_STRING_CHARS
    assert parse_json(json.dumps({"completion": at_limit}), "f.json") == {"completion": at_limit}
    with pytest.raises(InputError) as refusal:
        parse_json(json.dumps({"completion": at_limit + "a"}), "f.json")
    assert str(refusal.value) == (
        f'f.json: field "completion": a string of 4194305 characters, {LIMIT}')
    # An array element has no key: its offset names it. '[1, "' -> the quote is character 4.
    with pytest.raises(InputError) as refusal:
        parse_json(json.dumps([1, at_limit + "a"]), "f.jsonl:3")
    assert str(refusal.value) == (
        f"f.jsonl:3: the string at character 4: a string of 4194305 characters, {LIMIT}")
    # Escapes count as written: 2,097,153 x "\n" is 4,194,306 characters of text.
    with pytest.raises(InputError, match="a string of 4194306 characters"):
        parse_json(json.dumps({"k": "\n" * 2_097_153}), "f.json")


def test_the_scan_skips_brackets_in_strings_and_counts_the_rest():
    from grpogate.files.json_text import scan

    quoted = json.dumps({"a": "[" * 100, "b": '\\"[[[{{{' * 30})
    assert scan(quoted, 64).too_deep is False and json.loads(quoted)
    assert scan("[" * 64 + "]" * 64, 64).too_deep is False
    assert scan("[" * 65 + "]" * 65, 64).too_deep is True
    assert scan('{"a": ' + "[" * 65 + '"x"' + "]" * 65 + "}", 64).too_deep is True
    # An unclosed string ends the scan (json.loads then reports the text malformed).
    assert scan('"never closed ' + "[" * 100, 64).too_deep is False


def test_the_depth_check_allocates_nothing_per_character():
    # 66 opening brackets (> 64) make the scan run over a 2,000,000-character escaped string.
    # The old regex held ~120 bytes a character (240 MB here); the parse itself decodes the
    # string into 1,000,000 one-byte characters (1 MB).
    text = ('{"a": "' + "\\n" * 1_000_000 + '", "b": ' + "[" * 60 + "]" * 60
            + ', "c": [[[[[[]]]]]]}')
    tracemalloc.start()
    try:
        value = parse_json(text, "f.json")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert value["a"] == "\n" * 1_000_000
    assert peak < 8 * 1024 * 1024, peak



@pytest.mark.parametrize("value", [
    {"ascii": "plain", "latin": "caf\u00e9"},                       # 1 byte a character as it is
    {"text": "x" * 200 + "\U0001F600", "n": [1, 2.5, None]},        # escaped: 1 byte, not 4
    {"text": "x" * 200 + "\u4e2d\u6587", "k\u00e9y": "v"},           # escaped: 1 byte, not 2
    {"text": "\u4e2d" * 300},                                       # as it is: 2 bytes a character
    {"text": "\U0001F600" * 300},                                  # as it is: 4 = its UTF-8 bytes
])
def test_utf8_bytes_parse_to_the_values_json_loads_gives(value):
    from grpogate.files.json_text import compact_text

    data = json.dumps(value, ensure_ascii=False).encode("utf-8")
    assert parse_json(data, "f.json") == json.loads(data.decode("utf-8")) == value
    # Held in at most 3 bytes a byte of the file (sys.getsizeof: ~50 bytes of header).
    assert sys.getsizeof(compact_text(data)) - sys.getsizeof("") <= 3 * len(data)


def test_a_mostly_ascii_text_with_one_emoji_is_held_one_byte_a_character():
    from grpogate.files.json_text import compact_text

    # 1,000 ASCII characters and one emoji: decoded, 1,001 characters x 4 bytes = 4,004; as
    # escapes, 1,000 + 12 ("\ud83d\ude00") characters x 1 byte = 1,012 (+ the two quotes).
    text = compact_text(json.dumps("x" * 1000 + "\U0001F600", ensure_ascii=False).encode())
    assert text == '"' + "x" * 1000 + '\\ud83d\\ude00"' and text.isascii()


def test_bad_utf8_is_refused_at_its_byte_whichever_way_the_text_is_built():
    from grpogate.files.json_text import compact_text

    # The quote is byte 0, the x's bytes 1-1,000, one CJK character (E4 B8 AD) bytes
    # 1,001-1,003; the character begun at byte 1,004 (E4 B8) is cut short by the closing quote.
    mostly_ascii = b'"' + b"x" * 1000 + "\u4e2d".encode() + b"\xe4\xb8" + b'"'
    with pytest.raises(UnicodeDecodeError) as escaped:
        compact_text(mostly_ascii)
    with pytest.raises(UnicodeDecodeError) as direct:
        mostly_ascii.decode("utf-8")
    assert escaped.value.start == direct.value.start == 1004


# --- item 6: work bounded by the number of entries, not by their values -----------------------

LOG_PROGRAM = """
import json, sys
sys.path.insert(0, sys.argv[1])
from test_trainer_log import SETTINGS, entry, trainer_state
from grpogate.errors import InputError
from grpogate.evidence.trainer_log import log_steps
settings = {**SETTINGS, **json.loads(sys.argv[2])}
steps = json.loads(sys.argv[3])
state = trainer_state([entry(step, 0.5, 0.0, 0.5) for step in steps], steps[-1] if steps else 0)
try:
    print(json.dumps([[s["generations"], s["group_count"], s["valid_group_count"]]
                      for s in log_steps(state, settings, "t")]))
except InputError as error:
    print(json.dumps(str(error)))
"""


def read_log(settings: dict, steps: list[int]):
    """log_steps over entries at `steps` (frac 0.5) in a capped interpreter, 60 s at most (the
    old count looped over every step number): [[generations, groups, valid], ...] or the
    InputError's message."""
    result = capped("-c", LOG_PROGRAM, str(Path(__file__).parent), json.dumps(settings),
                    json.dumps(steps), timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


@pytest.mark.parametrize("iterations, generations", [
    # k in (1, 10**15] with (k - 1) % n == 0: the multiples of n in [1, 10**15 - 1].
    (1, 10**15 - 1),  # every step: 999,999,999,999,999
    (3, (10**15 - 1) // 3),  # 999,999,999,999,999 / 3 = 333,333,333,333,333 exactly
])
def test_a_step_of_10_to_the_15_is_counted_without_a_loop_over_steps(iterations, generations):
    # Per entry: 8 completions per generation / G = 4 -> 2 groups each; valid = (1 - 0.5) x
    # groups. The old count looped over every step number: 10**15 iterations, years.
    assert read_log({"num_iterations": iterations}, [1, 10**15]) == [
        [1, 2, 1], [generations, 2 * generations, generations]]


def test_the_closed_form_count_is_the_loop_it_replaces():
    from grpogate.evidence.trainer_log import _generations

    for n in range(1, 5):
        for previous in range(0, 12):
            for step in range(previous + 1, 14):
                assert _generations(previous, step, n) == sum(
                    (k - 1) % n == 0 for k in range(previous + 1, step + 1)), (previous, step, n)


def test_a_step_past_2_to_the_53_and_a_setting_past_2_to_the_20_are_refused():
    # 2**53 = 9,007,199,254,740,992; 2**20 = 1,048,576.
    assert read_log({}, [2**53 + 1]) == ("t log_history[0]: field 'step' must be a whole number "
                                         "after 0, at most 9007199254740992")
    assert read_log({"num_processes": 2**20 + 1}, []) == (
        "t: GRPO setting num_processes=1048577 is over 1048576; not a run a trainer logs")


REGEX = "(.*)*y"  # PEFT's re.fullmatch against each module name: exponential in its length


def forged_trl(directory: Path, adapter_config: dict | None = None, entries=()) -> Path:
    """A TRL output directory (test_trainer_log's), its adapter_config.json and log changed."""
    out = adapter_dir(directory)
    if adapter_config is not None:
        config = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**config, **adapter_config}))
    (out / "trainer_state.json").write_text(json.dumps(trainer_state(entries, len(entries))))
    return out


@pytest.mark.parametrize("field, value", [
    ("target_modules", REGEX), ("exclude_modules", REGEX), ("modules_to_save", [REGEX]),
    ("layers_pattern", REGEX), ("rank_pattern", {REGEX: 8}), ("alpha_pattern", {REGEX: 8}),
    ("target_modules", 7),
])
def test_a_pattern_peft_would_run_as_a_regex_is_refused_before_peft(tmp_path, field, value):
    from grpogate.inputs.policy import check_adapter_dir
    from grpogate.inputs.trl_output import read_trl_output

    out = forged_trl(tmp_path / "out", {field: value})
    shown = repr(REGEX if isinstance(value, (list, dict)) else value)
    message = f'adapter_config.json: field "{field}" is {shown}; grpogate loads an adapter whose'
    for read in (read_trl_output, lambda path: check_adapter_dir(str(path))):
        with pytest.raises(InputError) as refusal:
            read(out)
        assert message in str(refusal.value)


def test_module_names_and_all_linear_still_load(tmp_path):
    from grpogate.inputs.policy import check_adapter_dir
    from grpogate.inputs.trl_output import read_trl_output

    for patterns in ({"target_modules": ["q_proj", "v_proj"], "exclude_modules": ["lm_head"]},
                     {"target_modules": "all-linear", "layers_pattern": "layers",
                      "rank_pattern": {"model.layers.0.self_attn.q_proj": 4},
                      "modules_to_save": ["embed_tokens"]}):
        out = forged_trl(tmp_path / str(len(patterns)), patterns)
        assert read_trl_output(out).adapter_config["target_modules"] == patterns["target_modules"]
        assert check_adapter_dir(str(out)) == out


def test_gate_refuses_a_regex_target_modules_at_admission(tmp_path):
    out = forged_trl(tmp_path / "out", {"target_modules": REGEX})
    line = one_error(grpogate_cli("gate", "--from-trl", out, "--num-generations", 4,
                                  "--train-data", tmp_path / "absent.jsonl",
                                  "--out", tmp_path / "gated", timeout=120))
    assert f"adapter_config.json: field \"target_modules\" is '{REGEX}'" in line
    assert not (tmp_path / "gated").exists()


def test_the_configured_lora_target_modules_is_names_never_a_pattern():
    from grpogate.config.adapter_patterns import lora_targets

    assert lora_targets("all-linear") == "all-linear"
    assert lora_targets("q_proj, v_proj") == ["q_proj", "v_proj"]  # PEFT compares names
    with pytest.raises(InputError, match=r"lora_target_modules must be \"all-linear\" or a comma "
                                         r"list of module names .* \(got '\(\.\*\)\*y'\)"):
        grpogate.load_config("default", lora_target_modules=REGEX)


# --- item 8: one error line, nothing written ----------------------------------------------------

@pytest.mark.parametrize("figure, extra", [
    ("reward", {"reward": 1e308}),  # the old gate: ValueError writing evidence after the re-test
    ("completions/mean_length", {"completions/mean_length": 1e308}),  # OverflowError: round(inf)
    ("frac_reward_zero_std", {"frac_reward_zero_std": 1e308}),  # OverflowError: round(-inf)
    ("rewards/f/mean", {"rewards/f/mean": 1e308}),  # a weighted mean of inf
])
def test_gate_refuses_a_figure_that_would_overflow_at_admission(tmp_path, figure, extra):
    # 1e308 x 8 completions = inf (the largest float is 1.8e308): refused at admission, where
    # every logged figure must be within 1e100, before the baseline loads or a file is written.
    out = forged_trl(tmp_path / "out", entries=[{**entry(1, 0.5, 0.0, 0.5), **extra}])
    line = one_error(grpogate_cli("gate", "--from-trl", out, "--num-generations", 4,
                                  "--out", tmp_path / "gated", timeout=120))
    assert line.endswith(f"trainer_state.json log_history[0]: field {figure!r} must be a finite "
                         "number of magnitude at most 1e+100 (got 1e+308)"), line
    assert not (tmp_path / "gated").exists()


def test_a_fraction_of_groups_outside_0_1_is_refused():
    from grpogate.evidence.trainer_log import log_steps

    with pytest.raises(InputError, match=r"'frac_reward_zero_std' is a fraction of groups, in "
                                         r"\[0, 1\] \(got 1.5\)"):
        log_steps(trainer_state([entry(1, 1.5, 0.0, 0.5)], 1), SETTINGS, "t")


def test_gate_refuses_a_100000_deep_trl_args_toml(tmp_path):
    out = forged_trl(tmp_path / "out")
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    line = one_error(grpogate_cli("gate", "--from-trl", out, "--trl-args", deep,
                                  "--out", tmp_path / "gated", timeout=120))
    assert line == (f"error: {deep}: not valid TOML: arrays or tables nested deeper than any "
                    "settings file (Python's recursion limit)")
    assert not (tmp_path / "gated").exists()


def test_the_api_raises_its_input_error_for_bad_arguments_and_mutated_configs(tmp_path):
    with pytest.raises(InputError) as refusal:
        grpogate.load_config("default", task="chain_sum")  # a table belongs here
    assert str(refusal.value) == "task (--task): expected a table of keys (got 'chain_sum')"
    with pytest.raises(InputError) as refusal:
        grpogate.load_config("default", config_file=123)
    assert str(refusal.value) == "config_file: expected a name or path (got 123)"
    for key, value, kind in (("group_size", "8", "a whole number (int)"),
                             ("max_new_tokens", 2.5, "a whole number (int)"),
                             ("learning_rate", "1e-4", "a number"),
                             ("dynamic_sampling", 1, "true or false (bool)"),
                             ("task", "chain_sum", "a table of TaskConfig keys")):
        config = grpogate.load_config("smoke", out=str(tmp_path / key))
        setattr(config, key, value)
        with pytest.raises(InputError) as refusal:
            grpogate.run(config)
        assert str(refusal.value) == f"config: {key} must be {kind} (got {value!r})"
        assert not (tmp_path / key).exists()


def test_a_backslash_before_a_wide_character_stays_invalid_json():
    # Escaped, "\\é" would read as an escaped backslash and the letters u00e9: a value no other
    # reader gives. The text is decoded as it is, and json.loads refuses the escape.
    data = ('{"a": "\\é' + "x" * 1000 + '\U0001F600"}').encode("utf-8")
    with pytest.raises(json.JSONDecodeError, match="Invalid \\\\escape"):
        json.loads(data.decode("utf-8"))
    with pytest.raises(json.JSONDecodeError, match="Invalid \\\\escape"):
        parse_json(data, "f.json")


def test_many_runs_of_wide_characters_are_decoded_as_they_are():
    from grpogate.files.json_text import BYTES_PER_RUN, compact_text

    # "abĀ" is 4 bytes, one run of 2 non-ASCII bytes every 4 (> 1 per BYTES_PER_RUN = 16):
    # escaping would loop once a run; the text is decoded as it is (one emoji: 4 bytes a char).
    assert BYTES_PER_RUN == 16
    data = json.dumps("abĀ" * 10_000 + "\U0001F600", ensure_ascii=False).encode("utf-8")
    text = compact_text(data)
    assert text == data.decode("utf-8") and not text.isascii()
    # One run per 20 bytes (16 ASCII + a 4-byte emoji) is escaped: 16 + 12 characters each.
    sparse = json.dumps(("x" * 16 + "\U0001F600") * 1000, ensure_ascii=False).encode("utf-8")
    assert compact_text(sparse).isascii() and len(compact_text(sparse)) == 2 + 28 * 1000
