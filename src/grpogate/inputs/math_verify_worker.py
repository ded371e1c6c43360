"""The math-verify scorer's sandbox: a child process program, never imported by the package.

math-verify can run model output through sympy's `parse_expr`, which calls Python's `eval`: its
plain-expression extraction hands any digits-and-operators match (e.g. `2**3**4`) to
`parse_expr(..., evaluate=False)`, and latex2sympy builds sympy objects whose simplification can
take unbounded time and memory. Deep nesting can also overflow the C parser's stack and kill
the interpreter. So the library never runs in the training process: `MathVerifyVerifier`
(verifiers.py) starts this file as `python -I <this file>` (no PYTHONPATH, no user site, not
the grpogate package) and talks to it over pipes, one JSON line per completion, with a wall-
clock limit per completion after which it kills the child.

Before reading any request the child gives itself no way to harm the machine beyond its own
lifetime: it drops root to `nobody`, then allows no new processes (RLIMIT_NPROC 0, and the
process-creating os functions removed, so `os.system` / `subprocess` fail), no new file
descriptors (RLIMIT_NOFILE at the three it has: no file or socket can be opened), no file
writes (RLIMIT_FSIZE 0), bounded memory (RLIMIT_AS) and CPU time (RLIMIT_CPU), and no core
dumps. What it may still do is compute; its only output is one float per line.

Protocol: the child prints {"ready": version} once imported; then, for each request line
{"completion": str, "gold": str}, it prints {"reward": 1.0 | 0.0, "error": str | null}; for a
line {"gold": str} alone (admission's check of a reference), {"readable": bool, "error": ...}.

A reference is read as math-verify reads a model's answer: a bare LaTeX reference (`\\sqrt{8}`,
`2\\sqrt{2}`, `10^{6}`, as MATH-style datasets store answers, without `$...$`) parses to
nothing or to a wrong leading number unless it is delimited, so one holding a LaTeX mark and no
`$` is wrapped in `$...$` first (`gold_text`).
"""

import json
import resource
import sys

MEMORY_LIMIT_BYTES = 2 * 1024**3
CPU_LIMIT_SECONDS = 3600  # a lifetime cap; the per-completion limit is the parent's wall clock
PARSE_TIMEOUT_SECONDS = 3  # math-verify's own signal.alarm limits, inside the parent's limit


NOBODY = 65534
# Process-creating calls removed from the interpreter's own os module (belt and braces: with
# RLIMIT_NPROC 0 for a non-root user they fail anyway).
SEVERED = ("system", "popen", "fork", "forkpty", "execv", "execve", "spawnv", "spawnve",
           "posix_spawn", "posix_spawnp", "kill", "killpg")


def _lowest_free_descriptor() -> int:
    import os

    number = 0
    while True:
        try:
            os.fstat(number)
        except OSError:
            return number
        number += 1


def confine() -> None:
    """Drop root (RLIMIT_NPROC does not bind root), then the limits, then process creation."""
    import os
    import posix

    import signal

    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write over RLIMIT_FSIZE raises, not kills
    # The kernel gives a new descriptor the lowest free number; capping RLIMIT_NOFILE there
    # leaves every open one (stdin, stdout, stderr) usable and no new file or socket possible.
    for limit, value in ((resource.RLIMIT_NOFILE, _lowest_free_descriptor()),
                         (resource.RLIMIT_NPROC, 0), (resource.RLIMIT_FSIZE, 0),
                         (resource.RLIMIT_CORE, 0), (resource.RLIMIT_AS, MEMORY_LIMIT_BYTES),
                         (resource.RLIMIT_CPU, CPU_LIMIT_SECONDS)):
        resource.setrlimit(limit, (value, value))
    for module in (os, posix):
        for name in SEVERED:
            if hasattr(module, name):
                setattr(module, name, None)


LATEX_MARKS = ("\\", "^", "_", "{")


def gold_text(gold: str) -> str:
    """The reference as math-verify should parse it: bare LaTeX wrapped in `$...$`."""
    if "$" not in gold and any(mark in gold for mark in LATEX_MARKS):
        return f"${gold}$"
    return gold


def parse_gold(math_verify, gold: str) -> list:
    return math_verify.parse(gold_text(gold), parsing_timeout=PARSE_TIMEOUT_SECONDS)


def readable(math_verify, gold: str) -> bool:
    """True when the reference parses to a mathematical object (not only its own text)."""
    return any(not isinstance(item, str) for item in parse_gold(math_verify, gold))


def score(math_verify, completion: str, gold: str) -> float:
    gold_parsed = parse_gold(math_verify, gold)
    if not gold_parsed:
        return 0.0
    predicted = math_verify.parse(completion, parsing_timeout=PARSE_TIMEOUT_SECONDS)
    if not predicted:
        return 0.0
    return 1.0 if math_verify.verify(gold_parsed, predicted,
                                     timeout_seconds=PARSE_TIMEOUT_SECONDS) else 0.0


# Scored once before confinement, so that every module sympy and latex2sympy import lazily on
# first use (fractions, LaTeX, percentages, symbols, sets) is loaded while files may be read.
WARM_UP = (("\\boxed{\\frac{1}{2}}", "0.5"), ("so 50%", "0.5"), ("$x^2+2x+1$", "$(x+1)^2$"),
           ("\\boxed{\\frac{1}{\\sqrt{2}}}", "$\\pi$"), ("$\\{1, 2\\}$", "$(1, 2)$"),
           ("$1 < x < 2$", "$x = 3$"), ("\\boxed{2^{10}}", "1,000"),
           ("$\\boxed{2\\sqrt{2}}$", "\\sqrt{8}"))


def main() -> None:
    import math_verify
    from importlib import metadata

    version = metadata.version("math-verify")
    for completion, gold in WARM_UP:
        score(math_verify, completion, gold)
    confine()  # deep nesting raises RecursionError (caught below) or, at worst, kills the child
    print(json.dumps({"ready": version}), flush=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            if "completion" not in request:
                reply = {"readable": readable(math_verify, request["gold"]), "error": None}
            else:
                reply = {"reward": score(math_verify, request["completion"], request["gold"]),
                         "error": None}
        except BaseException as failure:  # noqa: BLE001 - any failure is a 0 for this request
            if isinstance(failure, KeyboardInterrupt):
                raise
            reply = {"reward": 0.0, "readable": False,
                     "error": f"{type(failure).__name__}: {str(failure)[:200]}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
