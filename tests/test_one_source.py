"""One source for every setting: the config schema (config/schema.py) holds every default.

No module outside config/ writes a literal default for a key the configuration sets (a
keyword default of a function, or a field default of a class): it reads the schema's
(`RunConfig.beta`, `DEFAULTS.beta`) or takes the value from its caller. Two copies of a
default drift apart (the update's own settings once said beta 0.02 while a run used 0.04).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import grpogate
from grpogate.config.schema import GuardConfig, RunConfig, TaskConfig

PACKAGE = Path(grpogate.__file__).parent
KEYS = {f.name for schema in (RunConfig, TaskConfig, GuardConfig) for f in dataclasses.fields(schema)}
# Parameters that share a configuration key's name but are not that setting.
NOT_THE_SETTING = {
    ("admission.py", "guard"),  # the admitted guard problems, not the guard config
    ("evidence/audit_files.py", "adapter"),  # whether to hash an adapter file
    ("evidence/metrics.py", "seed"), ("evidence/significance.py", "seed"),  # resampling seeds
    ("files/__init__.py", "path"),  # the file a message names
    ("inputs/policy.py", "adapter"),  # an adapter folder to load
    ("inputs/tasks.py", "source"),  # where an eval set was read, for messages
    ("sampling/retest.py", "label"),  # the progress line's label
    ("training/loop.py", "rewards"),  # a rollout's rewards
}


def _literal(node) -> bool:
    """A literal value, or `field(default=<literal>)`."""
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    if isinstance(node, ast.Call):  # field(default=...): its default; default_factory: not one
        node = next((k.value for k in node.keywords if k.arg == "default"), None)
        return node is not None and _literal(node)
    return isinstance(node, ast.Constant) and node.value is not None


def literal_defaults(path: Path) -> list[tuple[str, int]]:
    """(key, line) of every literal default `path` writes for a configuration key's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            positional = node.args.posonlyargs + node.args.args
            pairs = list(zip(positional[len(positional) - len(node.args.defaults):],
                             node.args.defaults))
            pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d]
            found += [(a.arg, node.lineno) for a, d in pairs if a.arg in KEYS and _literal(d)]
        elif isinstance(node, ast.ClassDef):
            found += [(s.target.id, s.lineno) for s in node.body
                      if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                      and s.target.id in KEYS and s.value is not None and _literal(s.value)]
    return found


def test_no_module_outside_config_defines_a_default_for_a_setting():
    copies = [f"{path.relative_to(PACKAGE)}:{line} {key}"
              for path in sorted(PACKAGE.rglob("*.py"))
              if path.relative_to(PACKAGE).parts[0] != "config"
              for key, line in literal_defaults(path)
              if (str(path.relative_to(PACKAGE)), key) not in NOT_THE_SETTING]
    assert not copies, "defaults written outside the schema: " + ", ".join(copies)


def test_the_check_finds_a_copied_default(tmp_path):
    module = tmp_path / "copy.py"
    module.write_text("from dataclasses import dataclass\n\n\n@dataclass\nclass S:\n"
                      "    beta: float = 0.02\n    delta: float = field(default=0.1)\n"
                      "    seed: int = field(default_factory=int)\n\n\n"
                      "def f(x, temperature=0.7, top_k=RunConfig.top_k):\n    return x\n")
    assert sorted(literal_defaults(module)) == [("beta", 6), ("delta", 7), ("temperature", 11)]


def test_the_update_reads_the_schemas_defaults():
    from grpogate.training.update import UpdateSettings

    settings, config = UpdateSettings(), RunConfig()
    assert (settings.beta, settings.micro_batch_size) == (config.beta, config.micro_batch_size)
    assert settings == UpdateSettings.from_config(config)
