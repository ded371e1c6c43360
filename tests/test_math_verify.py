"""math-verify-v1: equivalences it must grade, hostile inputs it must survive, and its sandbox.

math-verify hands some model output to sympy's parse_expr (an eval); the scorer therefore runs
in a confined child (inputs/math_verify_worker.py). These tests check the grading, that hostile
completions return 0 within the time limit and execute nothing, and — separately from what the
library happens to evaluate today — that code running inside the confined child cannot start a
process, open a file or write one.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("math_verify")

from grpogate.inputs import verifiers  # noqa: E402
from grpogate.inputs.verifiers import get_verifier  # noqa: E402

WORKER = Path(verifiers.__file__).with_name("math_verify_worker.py")


@pytest.fixture(scope="module")
def verifier():
    v = get_verifier("math-verify-v1")
    yield v
    v.close()


# (reference, completion, reward): each equivalence checked by hand.
CASES = [
    ("#### 0.5", "\\boxed{\\frac{1}{2}}", 1.0),            # 1/2 = 0.5
    ("#### 0.75", "$\\frac{3}{4}$", 1.0),                   # 3/4 = 0.75
    ("#### 0.5", "so 50%", 1.0),                            # 50 % = 0.5
    ("Work.\n#### 18", "The answer is 18.", 1.0),           # GSM8K reference format
    ("#### 18", "The answer is 17.", 0.0),
    ("#### 1/3", "$\\frac{1}{3}$", 1.0),
    ("#### $\\frac{\\sqrt{2}}{2}$", "\\boxed{\\frac{1}{\\sqrt{2}}}", 1.0),  # rationalized
    ("#### 2", "$\\boxed{4/2}$", 1.0),
    ("#### 1000", "\\boxed{1,000}", 1.0),                   # thousands separator
    ("#### $x^2+2x+1$", "\\boxed{(x+1)^2}", 1.0),           # expanded square
    ("#### 3", "\\boxed{3.0}", 1.0),
    ("#### 0.25", "\\boxed{25\\%}", 1.0),
    ("#### $\\pi$", "\\boxed{\\pi}", 1.0),
    ("#### 7", "\\boxed{8}", 0.0),
    ("#### 12", "", 0.0),
    ("#### $\\frac{1}{2}$", "$0.5$", 1.0),
    ("#### 1/3", "0.333", 0.0),                              # a rounding is not 1/3
]


@pytest.mark.parametrize("reference, completion, reward", CASES)
def test_equivalences(verifier, reference, completion, reward):
    assert verifier.score(completion, reference) == reward


def test_identity_and_types(verifier):
    assert verifier.name == "math-verify-v1" and verifier.version == "math-verify-v2"
    assert verifier.score(None, "#### 1") == 0.0 and verifier.score("1", None) == 0.0


@pytest.mark.parametrize("template", [
    "{code}", "The answer is {code}", "${code}$", "\\boxed{{{code}}}", "#### {code}",
    "\\boxed{{1}} {code} 2**{code}"])
def test_code_in_a_completion_returns_zero_and_runs_nothing(verifier, tmp_path, template):
    marker = tmp_path / "executed"
    code = f"__import__('os').system('touch {marker}')"
    started = time.perf_counter()
    assert verifier.score(template.format(code=code), "#### 7") == 0.0
    assert time.perf_counter() - started < verifier.time_limit_seconds + 1.0
    assert not marker.exists()


@pytest.mark.parametrize("completion", [
    "1" + "+1" * 500_000,                                  # a 1 MB expression: refused unsent
    "$" + "{" * 5000 + "1" + "}" * 5000 + "$",             # deeply nested braces
    "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",      # deeply nested parentheses
    "$2^{2^{2^{2^{2^{2^{2^{2}}}}}}}$",                     # a power tower
])
def test_hostile_input_returns_zero_within_the_time_limit(verifier, completion):
    started = time.perf_counter()
    assert verifier.score(completion, "#### 4") == 0.0
    assert time.perf_counter() - started < verifier.time_limit_seconds + 1.0
    assert verifier.score("\\boxed{4}", "#### 4") == 1.0  # and the scorer still works after


def test_a_completion_past_the_time_limit_kills_the_child_and_counts():
    verifier = get_verifier("math-verify-v1")
    verifier.time_limit_seconds = 1.0  # the tower takes math-verify's own 3 s alarm
    try:
        assert verifier.score("\\boxed{1}", "#### 1") == 1.0  # started, warm
        errors = verifier.error_count
        started = time.perf_counter()
        assert verifier.score("$2^{2^{2^{2^{2^{2^{2^{2}}}}}}}$", "#### 4") == 0.0
        assert time.perf_counter() - started < 1.5
        assert verifier.error_count == errors + 1
        assert verifier.score("\\boxed{4}", "#### 4") == 1.0  # a fresh child
    finally:
        verifier.close()


SANDBOXED = """
import os, runpy, socket, subprocess, sys  # loaded before: evaluated code may find them loaded
worker = runpy.run_path(sys.argv[1], run_name="sandbox_test")
worker["confine"]()
marker = sys.argv[2]
outcomes = []
def attempt(name, action):
    try:
        action()
        outcomes.append(name + ": allowed")
    except BaseException as error:
        outcomes.append(name + ": refused " + type(error).__name__)
attempt("import", lambda: __import__("ftplib"))
attempt("os.system", lambda: os.system("touch " + marker))
attempt("subprocess", lambda: subprocess.run(["touch", marker]))
attempt("open", lambda: open(marker, "w").write("x"))
attempt("read", lambda: open("/etc/hostname").read())
attempt("socket", lambda: socket.socket())
print("|".join(outcomes))
"""


def test_code_inside_the_confined_child_can_neither_spawn_nor_touch_files():
    # A directory anyone may write to (pytest's tmp_path is private to root): only the sandbox
    # can stop the write there, not file permissions.
    directory = Path(tempfile.mkdtemp(dir="/tmp"))
    directory.chmod(0o777)
    marker = directory / "escaped"
    result = subprocess.run([sys.executable, "-I", "-c", SANDBOXED, str(WORKER), str(marker)],
                            capture_output=True, text=True, timeout=60)
    outcomes = result.stdout.strip().split("|")
    assert [o.split(":")[0] for o in outcomes] == ["import", "os.system", "subprocess", "open",
                                                  "read", "socket"], result.stderr
    assert all("refused" in o for o in outcomes), outcomes
    assert not marker.exists()
    shutil.rmtree(directory)


GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


@pytest.mark.skipif(not GSM8K_DIR.is_dir(), reason=f"GSM8K not found at {GSM8K_DIR}")
def test_a_gsm8k_run_scored_by_math_verify_names_it_and_audits_clean(tiny_config, tmp_path):
    from grpogate import pipeline
    from grpogate.evidence.audit import audit_run

    config = tiny_config(tmp_path, "task.source=gsm8k", f"task.path={str(GSM8K_DIR)!r}",
                         "verifier=math-verify-v1", train_prompts=2, prompts_per_step=2,
                         eval_prompts=2)
    evidence = pipeline.run(config)
    assert evidence["inputs"]["verifier"] == {"name": "math-verify-v1",
                                              "version": "math-verify-v2"}
    assert evidence["inputs"]["rewards"][0]["version"] == "math-verify-v2"
    assert evidence["environment"]["math-verify"] == "0.9.0"
    audit = audit_run(evidence["run_dir"])  # re-scores every completion with math-verify again
    assert audit["mismatches"] == [] and audit["agrees"]


def test_a_run_scored_by_the_first_version_is_named_by_the_audit(tmp_path):
    """v1 read a bare LaTeX reference as text; v2 reads it as LaTeX. A run whose evidence says
    v1 scored it is not silently re-scored by v2: the audit names the version."""
    import json

    from synthetic_run import write_synthetic_run

    from grpogate.evidence.audit import audit_run

    run = write_synthetic_run(tmp_path)
    evidence = json.loads((run / "evidence.json").read_text())
    evidence["inputs"]["verifier"] = {"name": "math-verify-v1", "version": "math-verify-v1"}
    (run / "evidence.json").write_text(json.dumps(evidence))
    mismatches = {m["field"]: m for m in audit_run(run)["mismatches"]}
    assert mismatches["inputs.verifier.version"]["recorded"] == "math-verify-v1"
    assert mismatches["inputs.verifier.version"]["recomputed"] == "math-verify-v2"
