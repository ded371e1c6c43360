"""The house's rules, checked on the package's syntax tree (README "Files").

Wings in pipeline order of dependence: the foundation (errors, gates, config, seeding,
interrupts, files, the distributed World) -> engines -> inputs -> evidence -> sampling ->
training -> the top (pipeline, admission, cli/, review/, the restart logic in
distributed/elastic.py and the public re-exports). A module imports only its own wing or lower
ones, no two modules import each other (directly or around a longer circle), the pure layers
import no torch, and modules and functions stay short enough to read.

The engines are one wing with one door: everything above reaches a model's forward through
`grpogate.engines` (and its row layout, `engines.rows`), never an engine's own modules; the CPU
accelerator imports nothing from the pipeline; and the private torch / transformers / PEFT
attributes the accelerator relies on are touched inside the engines wing only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import grpogate

PACKAGE = Path(grpogate.__file__).parent
LAYERS = {"foundation": 0, "engines": 1, "inputs": 2, "evidence": 3, "sampling": 4, "training": 5,
          "top": 6}
FOUNDATION = {"errors", "gates", "config", "seeding", "interrupts", "files", "distributed",
              "__init__"}
# Modules of a foundation package that sit on top: a restarted torchrun job resumes its run,
# which needs the training wing's checkpoints.
TOP_MODULES = {"distributed.elastic"}
# Pure Python: anyone can decide, audit or compare without a model stack.
TORCH_FREE = ["evidence/decisions.py", "evidence/metrics.py", "evidence/assemble.py",
              "evidence/audit.py", "evidence/audit_files.py", "evidence/manifest.py",
              "inputs/verifiers.py", "inputs/tasks.py", "inputs/budget.py", "config/__init__.py",
              "config/schema.py", "config/validation.py", "config/loading.py", "config/keys.py",
              "gates.py", "seeding.py", "files/__init__.py", "files/tensors.py", "decisions.py",
              "verifiers.py",
              "review/signing.py"]
# Split by meaning past these (STYLE: modules of about 400 lines, functions of about 60).
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("grpogate",) + parts).removesuffix(".__init__")


def layer(module: str) -> int:
    parts = module.split(".")[1:]
    if not parts or ".".join(parts) in TOP_MODULES:
        # the package itself re-exports the public API (api.py): it sits on top
        return LAYERS["top"]
    if parts[0] in LAYERS and len(parts) > 1:
        return LAYERS[parts[0]]
    if parts[0] in LAYERS:  # the wing's package itself
        return LAYERS[parts[0]]
    return 0 if parts[0] in FOUNDATION else LAYERS["top"]


def imports(path: Path) -> set[str]:
    """Every grpogate module `path` imports, at any depth of the file (lazy imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpogate"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("grpogate"))
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))
MODULES = {module_name(p): p for p in SOURCES}
GRAPH = {name: imports(path) & set(MODULES) - {name} for name, path in MODULES.items()}


def test_the_wings_exist():
    for wing in ("engines", "inputs", "sampling", "training", "evidence"):
        assert (PACKAGE / wing / "__init__.py").is_file(), wing


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_a_higher_wing(name):
    higher = [m for m in GRAPH[name] if layer(m) > layer(name)]
    assert not higher, f"{name} (layer {layer(name)}) imports {higher}"


def test_no_import_circle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(GRAPH[name]):
            assert state.get(target) != 1, " -> ".join(path + [name, target])
            if target not in state:
                visit(target, path + [name])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [])


@pytest.mark.parametrize("relative", TORCH_FREE)
def test_pure_modules_import_no_torch(relative):
    path = PACKAGE / relative
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] == "torch" for a in node.names), relative
        elif isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] != "torch", relative
    # ...and nothing they import, transitively, does either.
    seen, todo = set(), [module_name(path)]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        text = MODULES[name].read_text(encoding="utf-8")
        assert "import torch" not in text, f"{relative} reaches {name}, which imports torch"
        todo.extend(GRAPH[name])


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_and_functions_stay_short(name):
    text = MODULES[name].read_text(encoding="utf-8")
    assert text.count("\n") <= MAX_MODULE_LINES, (
        f"{name}: {text.count(chr(10))} lines; split it by meaning (at most {MAX_MODULE_LINES})")
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{name}: {', '.join(long)}; at most {MAX_FUNCTION_LINES} lines each"


DOOR = {"grpogate.engines", "grpogate.engines.rows"}
# Private or undocumented attributes of torch, transformers and PEFT the accelerator relies on.
PRIVATE_ATTRIBUTES = {"_attn_implementation", "_forward_hooks", "_forward_pre_hooks",
                      "_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported"}


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not n.startswith("grpogate.engines")))
def test_only_the_door_leads_to_the_engines(name):
    inside = sorted(m for m in GRAPH[name] if m.startswith("grpogate.engines") and m not in DOOR)
    assert not inside, f"{name} imports {inside}; reach an engine through grpogate.engines"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("grpogate.engines.")))
def test_the_engines_import_nothing_from_the_pipeline(name):
    above = sorted(m for m in GRAPH[name] if not m.startswith("grpogate.engines")
                   and layer(m) != LAYERS["foundation"])
    assert not above, f"{name} imports {above}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not n.startswith("grpogate.engines")))
def test_private_apis_stay_inside_the_engines(name):
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    used = sorted({ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                   and (node.attr in PRIVATE_ATTRIBUTES
                        or ast.unparse(node).startswith("torch.ops"))})
    assert not used, f"{name} uses {used}: private APIs live behind the engines' door"
