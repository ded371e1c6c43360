"""What a user takes elsewhere: a portable adapter, files with the user's mode, the problems."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from grpogate import pipeline
from grpogate.config import BUNDLED_MODEL, RunConfig
from grpogate.files import atomic_write_bytes, atomic_write_json, read_jsonl
from grpogate.inputs.policy import (BUNDLED_PUBLIC_ID, adapter_state, default_cache_dir,
                                    load_policy, resolve_base_model)
from grpogate.inputs.tasks import prompt_id


@pytest.mark.parametrize("umask, expected", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_writes_honour_the_umask(tmp_path, umask, expected):
    previous = os.umask(umask)
    try:
        atomic_write_bytes(tmp_path / "a.bin", b"x")
        atomic_write_json(tmp_path / "b.json", {"x": 1})
        # What open() itself creates under the same umask: the two must agree.
        (tmp_path / "plain.txt").write_text("x")
    finally:
        os.umask(previous)
    for name in ("a.bin", "b.json", "plain.txt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == expected, name


@pytest.fixture(scope="module")
def run_dir(alternating_run) -> Path:
    """conftest's run on the alternating reward, written under umask 022."""
    return alternating_run[1]


def test_every_run_file_has_the_same_umask_mode(run_dir):
    modes = {str(p.relative_to(run_dir)): stat.S_IMODE(p.stat().st_mode)
             for p in run_dir.rglob("*") if p.is_file()}
    assert "evidence.json" in modes and "manifest.json" in modes
    assert set(modes.values()) == {0o644}, modes


def test_problems_file_holds_every_problem_and_is_pinned(run_dir):
    problems = read_jsonl(run_dir / "problems.jsonl")
    evidence = json.loads((run_dir / "evidence.json").read_text())
    config = evidence["config"]
    assert [p["split"] for p in problems] == (["train"] * config["train_prompts"]
                                              + ["eval"] * config["eval_prompts"]
                                              + ["guard"] * config["guard"]["prompts"])
    guard = config["guard"]
    for problem in problems:
        assert problem["prompt_id"] == prompt_id(problem["question"])
        name, params = (("chain_sum", config["task"]["params"]) if problem["split"] != "guard"
                        else (guard["task"], guard["params"]))
        assert problem["task"] == {"source": "reasoning-gym", "name": name, "params": params}
        assert problem["reference"]  # chain_sum's answer, e.g. "57"
    trained = {r["prompt_id"] for r in read_jsonl(run_dir / "trajectories.jsonl")}
    assert trained == {p["prompt_id"] for p in problems if p["split"] == "train"}
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert "problems.jsonl" in manifest["files"]


def test_the_adapter_config_names_a_local_base_by_its_path(run_dir, tiny_model_dir):
    adapter_config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(Path(tiny_model_dir).resolve())


def test_the_bundled_models_adapter_loads_in_peft_by_its_public_id(tmp_path):
    """Delivered from the bundled GGUF, the adapter names SmolLM2's Hugging Face id; PEFT loads
    it onto the cached HF-format copy that the id maps to here (no hub on this machine)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = RunConfig(model=BUNDLED_MODEL, device="cpu", dtype="float32", lora_r=4)
    policy = load_policy(config, seed=0)
    with torch.no_grad():  # a trained-looking adapter: B is zero when fresh
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.01)
    (tmp_path / "run").mkdir()
    pipeline.deliver_adapter(policy, tmp_path / "run")
    adapter_dir = tmp_path / "run" / "adapter"
    recorded = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert recorded["base_model_name_or_path"] == BUNDLED_PUBLIC_ID
    cache = resolve_base_model(BUNDLED_MODEL, "", default_cache_dir(config)).load_dir
    for file in adapter_dir.iterdir():
        assert cache not in file.read_text(errors="replace"), file.name
    readme = adapter_dir / "README.md"
    if readme.is_file():
        assert f"base_model: {BUNDLED_PUBLIC_ID}" in readme.read_text()

    hub = {BUNDLED_PUBLIC_ID: cache}  # the id -> where this machine has the weights
    base = AutoModelForCausalLM.from_pretrained(hub[recorded["base_model_name_or_path"]],
                                                dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, adapter_dir)
    saved, reloaded = adapter_state(policy.model), adapter_state(loaded)
    assert saved.keys() == reloaded.keys() and saved
    for name in saved:
        assert torch.equal(saved[name], reloaded[name]), name
    tokens = torch.tensor([[1, 504, 3458, 314]])
    with torch.no_grad():
        expected = policy.model(input_ids=tokens).logits
        assert torch.allclose(loaded(input_ids=tokens).logits, expected, atol=1e-5)


def _audit_in_a_fresh_interpreter(run_dir: Path, cwd: Path, prelude: str) -> dict:
    """audit_run in a new interpreter (this checkout's grpogate) after `prelude`; the audit."""
    import subprocess
    import sys

    import grpogate

    code = (prelude + "\nimport json\nfrom grpogate.evidence.audit import audit_run\n"
            f"print(json.dumps(audit_run({str(run_dir)!r})))\n")
    source = str(Path(grpogate.__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", code], check=True, timeout=300, cwd=cwd,
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": source})
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def honest_run_dir(honest_run) -> Path:
    """A run scored by the real verifier end to end (so every reward re-scores equal)."""
    return Path(honest_run["run_dir"])


def test_a_copied_run_decides_with_the_task_generator_disabled(honest_run_dir, tmp_path):
    """The reasoning-gym problem generator raises if called: the copied run still agrees,
    because the audit reads problems.jsonl (the scorer itself is reasoning-gym's, so the
    package stays importable here)."""
    import shutil

    copy = tmp_path / "elsewhere" / "copied"
    shutil.copytree(honest_run_dir, copy)
    prelude = ("import grpogate.inputs.tasks as tasks\n"
               "def _generate(*args, **kwargs):\n"
               "    raise RuntimeError('the task generator was called')\n"
               "tasks._generate = _generate\n")
    audit = _audit_in_a_fresh_interpreter(copy, tmp_path, prelude)
    assert audit["mismatches"] == [] and audit["agrees"] is True


def test_a_reasoning_gym_run_without_reasoning_gym_is_a_named_reject(honest_run_dir, tmp_path):
    audit = _audit_in_a_fresh_interpreter(honest_run_dir, tmp_path,
                                          "import sys\nsys.modules['reasoning_gym'] = None\n")
    assert audit["decision"] == "reject"
    assert [m["field"] for m in audit["mismatches"]][0].startswith(
        "inputs.verifier.name (verifier 'reasoning-gym/chain_sum' needs the reasoning-gym package")


def test_a_delivered_adapter_as_baseline_asks_no_hub(run_dir, tiny_model_dir, monkeypatch,
                                                     tmp_path):
    """Loaded back as a baseline (the next run's start), the adapter's public base name must not
    send PEFT to the hub each time the adapter's state is read (every step's version)."""
    import peft.utils.save_and_load as save_and_load

    asked = []
    monkeypatch.setattr(save_and_load, "check_file_exists_on_hf_hub",
                        lambda *args, **kwargs: asked.append(args) or None)
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(run_dir / "adapter", adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = BUNDLED_PUBLIC_ID  # as a bundled-model run writes it
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    policy = load_policy(RunConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"),
                         adapter=str(adapter))
    adapter_state(policy.model)
    assert asked == []
