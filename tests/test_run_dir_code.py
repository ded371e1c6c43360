"""A run directory is data, even where the user opts in: `decide --trust-reward-code` imports no
package that lives in the run directory (not even a parent package, to find the module), and
`decide --replay` runs no code the recorded model names, never asks whether to, loads no pickle
and loads no model or baseline from inside the run directory.

Every forged input plants code that creates a marker file when it runs; each command must leave
no marker, exit 2 with one `error:` line and no traceback, and write nothing into the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from synthetic_run import write_synthetic_run

from grpogate.files import atomic_write_json
from grpogate.inputs.rewards import load_user_reward, locate_module, user_reward_source

SRC = Path(__file__).resolve().parents[1] / "src"
# Creates the file GRPOGATE_TEST_MARKER names, when (if ever) it runs.
MARK = 'import os, pathlib\npathlib.Path(os.environ["GRPOGATE_TEST_MARKER"]).touch()\n'
REWARD_SOURCE = "def f(completion, reference):\n    return 1.0\n"


def grpogate(*args, marker: Path, cwd: Path | None = None, paths=()) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter, "y" on its standard input (a prompt would be answered)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), *map(str, paths)]),
           "COLUMNS": "200", "GRPOGATE_TEST_MARKER": str(marker)}
    return subprocess.run([sys.executable, "-m", "grpogate", *map(str, args)], cwd=cwd,
                          input="y\n", capture_output=True, text=True, timeout=300, env=env)


def snapshot(run: Path) -> dict:
    return {str(path.relative_to(run)): (path.lstat().st_mtime_ns, path.lstat().st_size)
            for path in sorted(run.rglob("*"))}


def assert_refused(result, marker: Path, *expected: str) -> None:
    output = result.stdout + result.stderr
    assert not marker.exists(), output
    assert result.returncode == 2, output
    assert "Traceback" not in output and "Do you wish to run the custom code" not in output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and result.stdout.strip() == "", output
    for text in expected:
        assert text in lines[0], lines[0]


def edit_evidence(run: Path, change) -> None:
    evidence = json.loads((run / "evidence.json").read_text())
    change(evidence)
    atomic_write_json(run / "evidence.json", evidence)


# --- --trust-reward-code: nothing in the run directory is imported to find the module -----------

def record_reward(run: Path, name: str) -> None:
    """The run's config and evidence name user reward `name` at the version of REWARD_SOURCE."""
    version = f"{name}@sha256:{hashlib.sha256(REWARD_SOURCE.encode()).hexdigest()[:16]}"

    def record(evidence):
        evidence["config"]["rewards"] = [{"name": "correctness", "weight": 1.0},
                                         {"name": name, "weight": 0.5}]
        evidence["inputs"]["rewards"].append({"name": name, "weight": 0.5, "version": version})
    edit_evidence(run, record)


def planted_package(run: Path, module_file: Path | None = None) -> str:
    """evilpkg/ in the run: an __init__.py that marks, and mod.py (or a link to `module_file`).
    The run records reward evilpkg.mod:f at the version of that very source, so only where the
    code lives can refuse it. Returns the reward's name."""
    package = run / "evilpkg"
    package.mkdir()
    (package / "__init__.py").write_text(MARK)
    if module_file is None:
        (package / "mod.py").write_text(REWARD_SOURCE)
    else:
        (package / "mod.py").symlink_to(module_file)
    record_reward(run, "evilpkg.mod:f")
    return "evilpkg.mod:f"


@pytest.mark.parametrize("found_by", ["current directory", "PYTHONPATH"])
def test_trusting_a_module_whose_package_is_in_the_run_directory_imports_nothing(
        tmp_path, found_by):
    run = write_synthetic_run(tmp_path)
    name = planted_package(run)
    marker = tmp_path / "marker"
    before = snapshot(run)
    if found_by == "current directory":
        result = grpogate("decide", ".", "--trust-reward-code", name, marker=marker, cwd=run)
    else:
        result = grpogate("decide", run, "--trust-reward-code", name, marker=marker,
                          cwd=tmp_path, paths=[run])
    assert_refused(result, marker, f"--trust-reward-code {name}: the module would be imported "
                   "from inside the run directory")
    assert snapshot(run) == before


def test_a_run_package_whose_module_links_out_of_it_is_refused(tmp_path):
    # The module's own file resolves outside the run, its package's __init__.py inside it.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "mod.py").write_text(REWARD_SOURCE)
    run = write_synthetic_run(tmp_path)
    name = planted_package(run, module_file=outside / "mod.py")
    marker = tmp_path / "marker"
    before = snapshot(run)
    result = grpogate("decide", run, "--trust-reward-code", name, marker=marker, cwd=tmp_path,
                      paths=[run])
    assert_refused(result, marker, "module 'evilpkg.mod' leads out of its package directory")
    assert snapshot(run) == before


def test_a_module_is_located_and_versioned_without_importing_its_package(tmp_path, monkeypatch):
    package = tmp_path / "grpogate_locate_12"
    package.mkdir()
    (package / "__init__.py").write_text(MARK)
    (package / "rewards.py").write_text(REWARD_SOURCE)
    marker = tmp_path / "marker"
    monkeypatch.setenv("GRPOGATE_TEST_MARKER", str(marker))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert locate_module("grpogate_locate_12.rewards").origin == str(package / "rewards.py")
        version, _ = user_reward_source("grpogate_locate_12.rewards:f")
        assert version == ("grpogate_locate_12.rewards:f@sha256:"
                           + hashlib.sha256(REWARD_SOURCE.encode()).hexdigest()[:16])
        assert not marker.exists() and "grpogate_locate_12" not in sys.modules
        # Loading (what the user opts in to) imports the package: the marker works.
        function, loaded_version = load_user_reward("grpogate_locate_12.rewards:f")
        assert marker.exists() and function("x", "y") == 1.0 and loaded_version == version
    finally:
        for module in ("grpogate_locate_12", "grpogate_locate_12.rewards"):
            sys.modules.pop(module, None)


def test_a_package_that_moves_its_path_is_not_loaded_as_the_versioned_module(tmp_path,
                                                                               monkeypatch):
    # The versioned file is the one found without importing; the import finds another.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "rewards.py").write_text("def f(completion, reference):\n    return 0.0\n")
    package = tmp_path / "grpogate_moved_12"
    package.mkdir()
    (package / "__init__.py").write_text(f"__path__.insert(0, {str(elsewhere)!r})\n")
    (package / "rewards.py").write_text(REWARD_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(ValueError, match="was imported from .*elsewhere/rewards.py, not "
                                             "from the versioned .*grpogate_moved_12/rewards.py"):
            load_user_reward("grpogate_moved_12.rewards:f")
    finally:
        for module in ("grpogate_moved_12", "grpogate_moved_12.rewards"):
            sys.modules.pop(module, None)


def test_a_trusted_reward_is_located_once_per_audit(tmp_path, monkeypatch):
    """Found, checked to lie outside the run, versioned and imported: one look-up in all, so
    the file imported is the one checked (load_user_reward holds the import to it)."""
    from grpogate.evidence.audit import audit_run
    from grpogate.inputs import rewards

    code = tmp_path / "code"
    code.mkdir()
    (code / "grpogate_once_12.py").write_text(REWARD_SOURCE)
    run = write_synthetic_run(tmp_path)
    name = "grpogate_once_12:f"
    record_reward(run, name)
    monkeypatch.syspath_prepend(str(code))
    located, real = [], rewards.locate_module
    monkeypatch.setattr(rewards, "locate_module",
                        lambda module: located.append(module) or real(module))
    try:
        audit = audit_run(run, trusted_rewards=[name])
    finally:
        sys.modules.pop("grpogate_once_12", None)
    assert located == ["grpogate_once_12"]
    assert audit["rescoring"]["components_rescored"] == ["correctness", name]


# --- --replay: the recorded model runs no code and is the user's own ----------------------------

def remote_code_model(directory: Path, tiny_model_dir: Path) -> Path:
    """The tiny model, its config naming its own code (auto_map, an unknown model_type) in
    evil.py, which marks when run."""
    shutil.copytree(tiny_model_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig",
                                               "AutoModelForCausalLM": "evil.EvilModel"})
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "evil.py").write_text(MARK)
    return directory


class Planted:
    """Unpickling this creates the marker (what a pickled pytorch_model.bin could do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def pickle_model(directory: Path, tiny_model_dir: Path, marker: Path) -> Path:
    """The tiny model's config and tokenizer, with weights only as a pickle that marks."""
    directory.mkdir()
    for path in tiny_model_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, directory / path.name)
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(Planted(marker)))
    return directory


def replay_with_model(run: Path, spec: str, marker: Path, cwd: Path):
    edit_evidence(run, lambda evidence: evidence["inputs"]["model"].update(spec=spec))
    before = snapshot(run)
    result = grpogate("decide", run, "--replay", "1", marker=marker, cwd=cwd)
    assert snapshot(run) == before
    return result


def test_replay_refuses_a_model_that_needs_its_own_code_without_asking(tmp_path,
                                                                       tiny_model_dir):
    model = remote_code_model(tmp_path / "model", tiny_model_dir)
    run = write_synthetic_run(tmp_path)
    marker = tmp_path / "marker"
    result = replay_with_model(run, str(model), marker, cwd=tmp_path)
    assert_refused(result, marker, f"{run}/evidence.json: --replay of field inputs.model.spec "
                   f"{model}: does not load (ValueError: The repository {model} contains "
                   "custom code")


def test_replay_refuses_pickled_model_weights(tmp_path, tiny_model_dir):
    marker = tmp_path / "marker"
    model = pickle_model(tmp_path / "model", tiny_model_dir, marker)
    run = write_synthetic_run(tmp_path)
    result = replay_with_model(run, str(model), marker, cwd=tmp_path)
    assert_refused(result, marker, "--replay of field inputs.model.spec", f"{model}: no model "
                   "weights (*.safetensors) in this directory; pickled *.bin weights are not "
                   "loaded")


@pytest.mark.parametrize("spec, cwd", [("{run}/model", "{root}"), ("model", "{run}"),
                                       ("{root}/link", "{root}")])
def test_replay_refuses_a_model_inside_the_run_directory(tmp_path, tiny_model_dir, spec, cwd):
    run = write_synthetic_run(tmp_path)
    remote_code_model(run / "model", tiny_model_dir)
    (tmp_path / "link").symlink_to(run / "model")
    marker = tmp_path / "marker"
    spec = spec.format(run=run, root=tmp_path)
    result = replay_with_model(run, spec, marker, cwd=Path(cwd.format(run=run, root=tmp_path)))
    assert_refused(result, marker, f"{run}/evidence.json: field inputs.model.spec: {spec} is "
                   "inside the run directory; --replay loads only a model and baseline adapter "
                   "of your own")


def test_replay_refuses_a_baseline_adapter_inside_the_run_directory(tmp_path):
    run = write_synthetic_run(tmp_path)
    marker = tmp_path / "marker"
    edit_evidence(run, lambda evidence: evidence["inputs"].update(
        baseline_adapter={"path": str(run / "adapter"), "sha256": "0" * 64}))
    before = snapshot(run)
    result = grpogate("decide", run, "--replay", "1", marker=marker, cwd=tmp_path)
    assert snapshot(run) == before
    assert_refused(result, marker, "field inputs.baseline_adapter.path: "
                   f"{run}/adapter is inside the run directory")


def test_the_dry_run_target_check_refuses_a_model_that_needs_its_own_code(tmp_path,
                                                                          tiny_model_dir,
                                                                          monkeypatch):
    import builtins

    from grpogate.config import RunConfig
    from grpogate.inputs.policy import check_target_modules

    model = remote_code_model(tmp_path / "model", tiny_model_dir)
    marker = tmp_path / "marker"
    monkeypatch.setenv("GRPOGATE_TEST_MARKER", str(marker))

    asked = []
    monkeypatch.setattr(builtins, "input", lambda *args: asked.append(args) or "n")
    with pytest.raises(ValueError, match="contains custom code"):
        check_target_modules(str(model), RunConfig())
    assert asked == [] and not marker.exists()  # refused, not asked about
