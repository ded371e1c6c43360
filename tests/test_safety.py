"""Safety properties of the package source, checked on its syntax tree.

Model output is text: nothing in grpogate evaluates it (no eval / exec / compile, no sympy or
math-verify, so no math-verify time limit is needed either). Every torch.load reads plain
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
            assert not any(m.split(".")[0] in ("sympy", "math_verify") for m in modules), path.name


@pytest.mark.parametrize("path", SOURCES, ids=IDS)
def test_every_torch_load_is_weights_only(path):
    for where, node in calls(path):
        if dotted(node.func) == "torch.load":
            flags = {k.arg: k.value for k in node.keywords}
            assert isinstance(flags.get("weights_only"), ast.Constant), where
            assert flags["weights_only"].value is True, where


def test_the_checks_see_the_one_torch_load():
    assert any(dotted(node.func) == "torch.load" for path in SOURCES for _, node in calls(path))
