"""Safety properties of the package source, checked on its syntax tree.

Model output is text: nothing in grpogate's own process evaluates it (no eval / exec / compile,
no sympy or math-verify import). The one library that may evaluate it, math-verify (sympy's
parse_expr calls eval), is imported only by inputs/math_verify_worker.py, which no module
imports: the verifier starts it as an isolated child (`python -I`), and it confines itself
(no root, no processes, no new file descriptors, no writes; tests/test_math_verify.py checks
that code inside it cannot spawn or open anything) before it reads the first completion. Every torch.load reads plain
tensor data (weights_only=True) and nothing else unpickles. Adapters load only from
safetensors (policy.check_adapter_dir; tests/test_policy.py and tests/test_bad_input.py), and a
manifest's paths cannot leave its directory (tests/test_pipeline.py, tests/test_bad_input.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import grpogate

PACKAGE = Path(grpogate.__file__).parent
SOURCES = sorted(PACKAGE.rglob("*.py"))
IDS = [str(p.relative_to(PACKAGE)) for p in SOURCES]
SANDBOX = PACKAGE / "inputs" / "math_verify_worker.py"  # runs only as a confined child process


def calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            yield f"{path.name}:{node.lineno}", node


def dotted(function: ast.expr) -> str:
    if isinstance(function, ast.Name):
        return function.id
    if isinstance(function, ast.Attribute):
        return f"{dotted(function.value)}.{function.attr}"
    return ""


@pytest.mark.parametrize("path", SOURCES, ids=IDS)
def test_no_code_evaluation(path):
    # `model.eval()` is torch's train/eval switch, an attribute call, not the builtin.
    for where, node in calls(path):
        name = dotted(node.func)
        assert name not in ("eval", "exec", "compile"), where
        assert name.rsplit(".", 1)[-1] not in ("parse_expr", "sympify", "parse_latex"), where
        assert name not in ("pickle.load", "pickle.loads"), where
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
            assert not any(m.split(".")[0] == "sympy" for m in modules), path.name
            assert path == SANDBOX or not any(m.split(".")[0] == "math_verify"
                                              for m in modules), path.name
            # The sandbox is never imported: only started, as a child process, by path.
            assert not any(m.rsplit(".", 1)[-1] == "math_verify_worker" for m in modules), path.name


def test_the_sandbox_is_started_isolated_and_confines_itself_before_reading():
    verifiers_source = (PACKAGE / "inputs" / "verifiers.py").read_text(encoding="utf-8")
    assert '[sys.executable, "-I", str(worker)]' in verifiers_source
    assert 'with_name("math_verify_worker.py")' in verifiers_source
    tree = ast.parse(SANDBOX.read_text(encoding="utf-8"))
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    order = []  # main's statements, in order: the confine() call and the loop over stdin
    for statement in main.body:
        if (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
                and dotted(statement.value.func) == "confine"):
            order.append("confine")
        elif isinstance(statement, ast.For) and dotted(statement.iter) == "sys.stdin":
            order.append("read")
    assert order == ["confine", "read"]
    # The worker imports math_verify inside main (before confinement), nowhere at module level.
    assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) and any(
        a.name == "math_verify" for a in n.names) for n in tree.body)


@pytest.mark.parametrize("path", SOURCES, ids=IDS)
def test_every_torch_load_is_weights_only(path):
    for where, node in calls(path):
        if dotted(node.func) == "torch.load":
            flags = {k.arg: k.value for k in node.keywords}
            assert isinstance(flags.get("weights_only"), ast.Constant), where
            assert flags["weights_only"].value is True, where


def test_the_checks_see_the_one_torch_load():
    assert any(dotted(node.func) == "torch.load" for path in SOURCES for _, node in calls(path))
