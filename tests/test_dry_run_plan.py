"""The dry run plans (issue 60): a hub id is resolved as the run resolves it (offline from the
Hugging Face cache, with one `error:` line naming the id when it is not there), pinned to its
commit, and then checked as the bundled model is; `--json` prints the report alone on stdout,
without it a short summary ending in "dry run passed"; `gate --dry-run` makes the gate's checks
before sampling and prints the same kind of plan. Nothing is written by any of them.

The hub cache here is the layout huggingface_hub writes (blobs, snapshots/<commit>/ links,
refs/main: helpers.hub_cache) holding the tiny model; offline throughout (HF_HUB_OFFLINE=1 in a
fresh interpreter's environment, or huggingface_hub's constants patched in-process).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import TINY_SIZES
from helpers import hub_cache
from test_candidate_gate import made  # noqa: F401 -- the fixture: real PEFT / merged candidates
from typer.testing import CliRunner

from grpogate.cli import app
from grpogate.errors import InputError

SRC = Path(__file__).resolve().parents[1] / "src"
REPO_ID = "tiny-org/tiny-llama"
PASSED = "dry run passed: configuration, inputs and environment are usable"
# The tiny Llama's linear layers: 2 blocks of q, k, v, o, gate, up, down; one LoRA A and B each.
TINY_LORA_TENSORS = 2 * 7 * 2


def tiny_sets() -> list[str]:
    return sum((["--set", f"{key}={json.dumps(value)}"] for key, value in TINY_SIZES.items()), [])


def offline_cli(cache: Path, cwd: Path, *args) -> subprocess.CompletedProcess:
    """`grpogate ARGS` in a fresh interpreter, offline, with `cache` as the Hugging Face cache."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200", "HF_HUB_OFFLINE": "1",
           "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent / "hf-home")}
    return subprocess.run([sys.executable, "-m", "grpogate", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, offline, for in-process calls."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


# --- a hub id, resolved as the run resolves it --------------------------------------------------

def test_a_hub_id_absent_from_an_offline_cache_is_refused_naming_the_id(tmp_path):
    """Before: "dry run passed", exit 0, memory null, for any owner/name id."""
    cache, work = tmp_path / "hub", tmp_path / "work"
    cache.mkdir(), work.mkdir()
    result = offline_cli(cache, work, "run", "--model", "nobody/nonexistent-model-xyz",
                         "--dry-run", "--out", work / "run")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: nobody/nonexistent-model-xyz: not in the Hugging Face cache ({cache}) and the "
        "hub cannot be reached (HF_HUB_OFFLINE=1); download it once with network access (`hf "
        "download nobody/nonexistent-model-xyz`), or name a local model folder"]
    assert list(work.iterdir()) == [] and list(cache.iterdir()) == []


def test_a_hub_model_in_an_offline_cache_passes_the_dry_run_at_its_commit(tiny_model_dir,
                                                                          tmp_path):
    """Every check the bundled model gets (prompt lengths, LoRA targets, memory, disk) runs on
    the cached snapshot: its memory estimate is the local folder's, its revision the commit."""
    from grpogate.admission import dry_run
    from grpogate.config import load_config

    cache, work = tmp_path / "hub", tmp_path / "work"
    work.mkdir()
    commit = hub_cache(tiny_model_dir, cache, REPO_ID)
    result = offline_cli(cache, work, "run", "--profile", "smoke", "--model", REPO_ID,
                         "--dry-run", "--json", "--device", "cpu", "--out", work / "run",
                         *tiny_sets())
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    model = report["model"]
    assert (model["kind"], model["location"], model["revision"]) == ("hf-id", REPO_ID, commit)
    assert model["sha256"] == hashlib.sha256(f"{REPO_ID}@{commit}".encode()).hexdigest()
    local = dry_run(load_config("smoke", overrides=[f"{k}={json.dumps(v)}" for k, v in
                                                    TINY_SIZES.items()],
                                model=str(tiny_model_dir), device="cpu", out=str(tmp_path / "x")))
    assert report["memory_estimate_bytes"] == local["memory_estimate_bytes"] > 0
    assert report["engine"] == local["engine"] and report["engine"]["name"] == "cpu"
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("names, missing", [
    (["config.json", "tokenizer.json", "tokenizer_config.json"], "model.safetensors"),
    (["config.json", "tokenizer.json", "tokenizer_config.json", "pytorch_model.bin"],
     "model.safetensors"),
], ids=["weights-not-cached", "pickle-only"])
def test_a_cached_model_without_its_safetensors_weights_is_refused(tiny_model_dir, tmp_path,
                                                                    offline_cache, names, missing):
    from grpogate.inputs.policy import resolve_base_model

    source = tmp_path / "model"
    source.mkdir()
    for name in names:
        data = b"not a pickle" if name.endswith(".bin") else (tiny_model_dir / name).read_bytes()
        (source / name).write_bytes(data)
    commit = hub_cache(source, offline_cache, REPO_ID)
    with pytest.raises(InputError) as refused:
        resolve_base_model(REPO_ID, "", tmp_path / "grpogate-cache", weights=False)
    assert str(refused.value).startswith(
        f"{REPO_ID}@{commit}: {missing} is not in the Hugging Face cache")
    assert "pickled *.bin weights are never loaded" in str(refused.value)


def test_the_revision_is_pinned_and_a_missing_one_named(tiny_model_dir, tmp_path, offline_cache):
    from grpogate.inputs.policy import resolve_base_model

    commit = hub_cache(tiny_model_dir, offline_cache, REPO_ID)
    by_commit = resolve_base_model(REPO_ID, commit, tmp_path, weights=False)
    assert by_commit.revision == commit
    assert Path(by_commit.load_dir) == offline_cache / "models--tiny-org--tiny-llama" / \
        "snapshots" / commit
    with pytest.raises(InputError, match=f"^{REPO_ID}: not in the Hugging Face cache at "
                                         "revision 'dev'"):
        resolve_base_model(REPO_ID, "dev", tmp_path, weights=False)
    with pytest.raises(InputError, match="not a branch, tag or commit name"):
        resolve_base_model(REPO_ID, "../../etc", tmp_path, weights=False)


def test_the_run_loads_the_snapshot_the_dry_run_checked(tiny_model_dir, tiny_config, tmp_path,
                                                        offline_cache):
    """One rule for both: load_policy resolves the hub id to the same commit and folder."""
    from grpogate.inputs.policy import load_policy

    commit = hub_cache(tiny_model_dir, offline_cache, REPO_ID)
    policy = load_policy(dataclasses.replace(tiny_config(tmp_path), model=REPO_ID))
    assert policy.base.revision == commit
    assert policy.base.load_dir == str(offline_cache / "models--tiny-org--tiny-llama" /
                                       "snapshots" / commit)
    assert policy.base.sha256 == hashlib.sha256(f"{REPO_ID}@{commit}".encode()).hexdigest()


# --- what `run --dry-run` prints ----------------------------------------------------------------

def run_dry(tiny_model_dir, tmp_path, *extra):
    return CliRunner().invoke(app, ["run", "--profile", "smoke", "--model", str(tiny_model_dir),
                                    "--dry-run", "--device", "cpu", "--dtype", "float32",
                                    "--out", str(tmp_path / "run"), *extra, *tiny_sets()],
                              env={"COLUMNS": "200"})


def test_the_json_report_is_alone_on_stdout_with_engine_dtype_and_gates(tiny_model_dir,
                                                                        tmp_path):
    result = run_dry(tiny_model_dir, tmp_path, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["device"], report["dtype"]) == ("cpu", "float32")
    assert report["engine"]["name"] == "cpu" and report["engine"]["declined"] == ""
    # The smoke profile sets no [gates]: the defaults of gates.Gates.
    assert report["gates"]["minimum_valid_group_ratio"] == 0.2
    assert report["gates"]["maximum_peak_allocated_bytes"] == 10 * 1024**3
    assert report["gates"]["maximum_guard_reward_loss"] == 0.05
    assert (report["train_prompts"], report["eval_prompts"], report["steps"]) == (4, 4, 2)
    assert result.stderr.strip() == PASSED
    assert list(tmp_path.iterdir()) == []


def test_without_json_a_summary_ends_in_dry_run_passed(tiny_model_dir, tmp_path):
    result = run_dry(tiny_model_dir, tmp_path)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[-1] == PASSED
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.stdout)
    assert lines[0].startswith(f"model: {tiny_model_dir} (hf-dir, sha256 ")
    assert "engine: cpu; device cpu, dtype float32" in lines
    assert "prompts: 4 train, 4 eval, 8 guard; 2 steps" in lines
    assert any(line.startswith("gates: minimum_valid_group_ratio 0.2, ") and
               "maximum_peak_allocated_bytes 10.0 GiB" in line for line in lines)
    assert any(line.startswith("memory: about ") for line in lines)
    assert any(line.startswith("re-test: ") for line in lines)
    assert list(tmp_path.iterdir()) == []


# --- gate --dry-run -----------------------------------------------------------------------------

def gate_dry(candidate, baseline, out, *extra):
    return CliRunner().invoke(app, ["gate", "--profile", "smoke", "--candidate", str(candidate),
                                    "--baseline", str(baseline), "--out", str(out),
                                    "--device", "cpu", "--dtype", "float32", "--dry-run",
                                    *extra, *tiny_sets()], env={"COLUMNS": "200"})


def test_gate_dry_run_checks_the_candidate_and_writes_nothing(made, tiny_model_dir,  # noqa: F811
                                                              tmp_path):
    result = gate_dry(made / "adapter", tiny_model_dir, tmp_path / "gated", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["door"] == "candidate" and report["candidate"]["kind"] == "peft_adapter"
    assert report["baseline_identity"]["matches"] is True
    assert report["finite_weights"]["tensors_checked"] == TINY_LORA_TENSORS
    assert report["finite_weights"]["non_finite_tensors"] == 0
    assert (report["eval_prompts"], report["device"], report["dtype"]) == (4, "cpu", "float32")
    assert report["gates"]["minimum_reward_gain"] == 0.0
    assert report["baseline"]["kind"] == "hf-dir"
    # A gate's cost is the load and the re-test: no training stage takes time or memory, and
    # the adapter is held without an optimizer.
    expected = report["time_estimate"]["expected_seconds"]
    assert expected["rollout"] == expected["update"] == expected["checkpoints"] == 0.0
    assert expected["retest"] > 0 and expected["total"] > expected["retest"]
    parts = report["memory_estimate_gib"]["parts"]
    assert set(parts) == {"runtime", "weights", "adapter", "re-test tensors"}
    assert report["memory_estimate_gib"]["expected_peak"] == pytest.approx(
        sum(parts.values()), abs=0.03)  # each part and the total rounded to 0.01 GiB
    assert list(tmp_path.iterdir()) == []
    plain = gate_dry(made / "full", tiny_model_dir, tmp_path / "gated")
    assert plain.exit_code == 0, plain.output
    lines = plain.stdout.splitlines()
    assert lines[-1] == PASSED
    assert any(line.startswith(f"candidate: full_checkpoint {made / 'full'} (1 weight file(s)")
               for line in lines)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", ["missing-candidate", "json-without-dry-run"])
def test_gate_dry_run_refuses_bad_input_as_the_gate_would(made, tiny_model_dir,  # noqa: F811
                                                          tmp_path, case):
    if case == "missing-candidate":
        result = gate_dry(tmp_path / "absent", tiny_model_dir, tmp_path / "gated")
    else:
        result = CliRunner().invoke(app, ["gate", "--candidate", str(made / "adapter"), "--json"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []


# --- online: the dry run fetches the metadata and lists the weights, never downloads them -------

def fake_hub(monkeypatch, folder: Path, listed: dict):
    """huggingface_hub.snapshot_download replaced by a hub whose commit is `folder` and whose
    listing of it holds `listed` {file: size}; -> the calls it got (revision, patterns, dry)."""
    import huggingface_hub

    calls = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, dry_run=False, **_):
        calls.append((revision, tuple(allow_patterns), dry_run))
        if dry_run:
            return [SimpleNamespace(filename=name, file_size=size)
                    for name, size in listed.items() if name in allow_patterns]
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


@pytest.fixture
def snapshot(tmp_path) -> Path:
    folder = tmp_path / "snapshots" / ("ab" * 20)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


def test_online_the_dry_run_downloads_metadata_only_and_the_run_the_weights(monkeypatch,
                                                                           snapshot):
    from grpogate.inputs.hub_model import METADATA_FILES, resolve_hub_model

    calls = fake_hub(monkeypatch, snapshot, {"model.safetensors": 1234, "pytorch_model.bin": 9})
    planned = resolve_hub_model(REPO_ID, "", weights=False)
    assert (planned.commit, planned.weight_files, planned.weight_bytes) == (
        "ab" * 20, ("model.safetensors",), 1234)
    assert calls == [(None, tuple(METADATA_FILES), False),
                     ("ab" * 20, ("model.safetensors",), True)]  # listed, not downloaded
    calls.clear()
    (snapshot / "model.safetensors").write_bytes(b"x" * 1234)  # what the download leaves
    loaded = resolve_hub_model(REPO_ID, "v1.0", weights=True)
    assert calls == [("v1.0", tuple(METADATA_FILES), False),
                     ("ab" * 20, ("model.safetensors",), False)]
    assert loaded.weight_bytes == 1234


def test_online_a_pickle_only_repository_and_a_hostile_index_are_refused(monkeypatch, snapshot):
    from grpogate.inputs.hub_model import resolve_hub_model

    fake_hub(monkeypatch, snapshot, {"pytorch_model.bin": 9})
    with pytest.raises(InputError, match=f"^{REPO_ID}@{'ab' * 20}: the hub lists no "
                                         "model.safetensors; the weights load from safetensors"):
        resolve_hub_model(REPO_ID, "", weights=False)
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-1.safetensors", "b": "../../outside.safetensors"}}))
    with pytest.raises(InputError, match="names '../../outside.safetensors'; a shard is a "
                                         ".safetensors file beside the index"):
        resolve_hub_model(REPO_ID, "", weights=False)
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-2.safetensors", "b": "model-1.safetensors",
                        "c": "model-1.safetensors"}}))
    fake_hub(monkeypatch, snapshot, {"model-1.safetensors": 10, "model-2.safetensors": 20})
    sharded = resolve_hub_model(REPO_ID, "", weights=False)
    assert (sharded.weight_files, sharded.weight_bytes) == (
        ("model-1.safetensors", "model-2.safetensors"), 30)
