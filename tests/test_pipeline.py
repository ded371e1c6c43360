"""End-to-end runs of the pipeline on a tiny random-weight Llama and reasoning-gym chain_sum.

A random model never earns a chain_sum reward, so the main run replaces the training-time
verifier with a fixed reward pattern (even samples 1, odd samples 0): every group is then valid,
real optimizer steps happen and the policy version moves between steps. The re-test still uses
the real verifier. A second run keeps the real verifier end to end and must end in `reject`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from helpers import sha256

from grpogate.evidence import decisions
from grpogate import admission, pipeline
from grpogate.config import load_config
from grpogate.errors import InputError
from grpogate.files import read_jsonl
from grpogate.inputs.policy import load_policy

GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
needs_gsm8k = pytest.mark.skipif(not GSM8K_DIR.is_dir(), reason=f"GSM8K not found at {GSM8K_DIR}")

TRAIN_PROMPTS, GROUP_SIZE, STEPS = 4, 4, 2


def file_states(directory: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(directory)): (sha256(p), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(alternating_run):
    """One run with a reward signal (conftest's, shared across modules); returns (config,
    run_dir, evidence as returned)."""
    return alternating_run


def load_evidence(run_dir: Path) -> dict:
    return json.loads((run_dir / "evidence.json").read_text())


def test_run_writes_every_file_and_the_manifest_pins_them(finished):
    _, run_dir, _ = finished
    for name in ("evidence.json", "trajectories.jsonl", "eval_completions.jsonl",
                 "adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                 "manifest.json"):
        assert (run_dir / name).is_file(), name
    manifest = json.loads((run_dir / "manifest.json").read_text())
    weights = run_dir / "adapter" / "adapter_model.safetensors"
    assert manifest["adapter"] == {"path": "adapter", "sha256": sha256(weights)}
    assert set(manifest["files"]) >= {"evidence.json", "trajectories.jsonl",
                                      "eval_completions.jsonl", "adapter/adapter_config.json",
                                      "adapter/adapter_model.safetensors"}
    for name, digest in manifest["files"].items():
        assert sha256(run_dir / name) == digest, name
    evidence = load_evidence(run_dir)
    assert manifest["decision"] == evidence["decision"]["decision"]
    assert manifest["trajectory_identity"]["trace_count"] == TRAIN_PROMPTS * GROUP_SIZE
    assert manifest["rollback_source"]["policy_version"] == evidence["inputs"]["baseline_policy_version"]


def test_tensorboard_events_carry_every_step(finished):
    """Read back with the tensorboard package itself, at the terminal's step numbers 1..N."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config, run_dir, _ = finished
    assert len(list(Path(config.tensorboard).glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(config.tensorboard)
    events.Reload()
    steps = load_evidence(run_dir)["steps"]
    rewards = events.Scalars("train/reward")
    assert [event.step for event in rewards] == list(range(1, STEPS + 1))
    for event, record in zip(rewards, steps):
        assert event.value == pytest.approx(record["mean_reward"], rel=1e-6)  # stored as float32
    assert set(events.Tags()["scalars"]) >= {"train/valid_group_ratio", "update/mean_kl",
                                             "update/clip_fraction", "time/rollout_seconds",
                                             "decision/accept", "final/reward_mean_gain"}
    verdict = load_evidence(run_dir)["decision"]["decision"]
    assert events.Scalars(f"decision/{verdict}")[-1].value == 1.0


def test_trajectories_are_complete_and_carry_their_step_policy_version(finished):
    _, run_dir, _ = finished
    trajectories = read_jsonl(run_dir / "trajectories.jsonl")
    evidence = load_evidence(run_dir)
    assert len(trajectories) == TRAIN_PROMPTS * GROUP_SIZE
    assert len({t["trace_id"] for t in trajectories}) == len(trajectories)
    step_versions = {s["step"]: s["policy_version"] for s in evidence["steps"]}
    assert sorted(step_versions) == list(range(STEPS))
    for record in trajectories:
        assert record["source_policy_version"] == step_versions[record["step"]]
        assert record["verifier_version"] == evidence["inputs"]["verifier"]["version"]
        assert record["reward"] == (1.0 if record["sample_index"] % 2 == 0 else 0.0)
    # Step 0 updated the adapter, so step 1 sampled from a new policy version.
    assert step_versions[0] != step_versions[1]
    assert evidence["artifact"]["new_policy_version"] not in step_versions.values()
    eval_records = read_jsonl(run_dir / "eval_completions.jsonl")
    assert len(eval_records) == 2 * 4 * 2  # baseline + candidate, 4 prompts x G_eval = 2
    assert {r["policy"] for r in eval_records} == {"baseline", "candidate"}
    train_ids = {t["prompt_id"] for t in trajectories}
    assert not train_ids & {r["prompt_id"] for r in eval_records}


def test_evidence_records_every_spec_quantity(finished):
    config, run_dir, _ = finished
    evidence = load_evidence(run_dir)
    rollout, update = evidence["rollout"], evidence["update"]
    # Every group is valid under the alternating rewards: 2 steps x 2 groups of 4.
    assert rollout["total_trajectories"] == TRAIN_PROMPTS * GROUP_SIZE
    assert rollout["group_count"] == 4 and rollout["valid_group_count"] == 4
    assert evidence["valid_group_ratio"] == rollout["valid_group_ratio"] == 1.0
    assert evidence["effective_trajectory_count"] == 16
    timings = evidence["timings"]
    for stage in ("rollout", "verification", "update", "evaluation"):
        assert timings[f"{stage}_seconds"] >= 0.0
    assert timings["rollout_seconds"] > 0 and timings["update_seconds"] > 0
    cost = timings["rollout_seconds"] + timings["verification_seconds"] + timings["update_seconds"]
    assert evidence["effective_trajectories_per_second"] == pytest.approx(16 / cost)
    assert 0.0 <= rollout["max_length_hit_ratio"] <= 1.0
    # The tiny Llama is sampled through the lean decoder (merged LoRA weights), its step native
    # where the kernels build here; each step says which.
    import torch

    from grpogate.engines.cpu.native import native_kernels

    lean = "lean-native" if native_kernels(torch.float32, torch.device("cpu")) else "lean"
    assert rollout["decode_paths"] == [lean]
    assert [s["decode_path"] for s in evidence["steps"]] == [lean] * STEPS
    assert rollout["generation_tokens_per_second"] > 0
    assert update["epsilon"] == config.epsilon and update["beta"] == config.beta
    assert update["mean_kl"] >= 0.0
    assert 0.0 <= update["clip_fraction"] <= 1.0
    assert update["update_count"] == STEPS  # one optimizer step per rollout (groups_per_update 0)
    assert evidence["status"] == "ok"
    resources = evidence["resources"]
    assert resources["peak_allocated_bytes"] > 0 and resources["peak_reserved_bytes"] > 0
    assert evidence["contract"]["admitted"] is True


def test_decision_is_the_pure_decision_of_the_stored_evidence(finished):
    config, run_dir, returned = finished
    evidence = load_evidence(run_dir)
    stored = evidence.pop("decision")
    assert stored["decision"] in ("accept", "tune", "reject")
    recomputed = decisions.decide_run(evidence, dataclasses.asdict(config.gates))
    assert json.loads(json.dumps(recomputed)) == stored
    assert returned["decision"]["decision"] == stored["decision"]
    # The random model truncates nearly every answer: the length gates cannot pass.
    assert stored["decision"] != "accept"


def test_second_run_into_the_same_out_is_refused(finished, tiny_config):
    config, run_dir, _ = finished
    before = file_states(run_dir)
    again = tiny_config(run_dir.parent, out=str(run_dir))
    with pytest.raises(InputError, match="already exists"):
        pipeline.run(again)
    assert file_states(run_dir) == before


def test_run_without_reward_signal_is_rejected(honest_run):
    evidence = honest_run  # conftest's run of 2 + 2 prompts with the real verifier
    assert evidence["status"] == "no_effective_update"
    assert evidence["update"]["update_count"] == 0
    assert evidence["decision"]["decision"] == "reject"
    assert "execution" in evidence["decision"]["failed_checks"]
    assert (Path(evidence["run_dir"]) / "manifest.json").is_file()


# --- admission ---------------------------------------------------------------------------------


@needs_gsm8k
def test_gsm8k_train_eval_overlap_is_refused_before_writing(tiny_config, tmp_path):
    config = tiny_config(tmp_path, "task.source=gsm8k", f"task.path={json.dumps(str(GSM8K_DIR))}",
                         "task.train_split=test", "task.eval_split=test", "task.train_seed=5",
                         "task.eval_seed=5")
    with pytest.raises(InputError, match="share"):
        pipeline.admit(config)
    assert not (tmp_path / "run").exists()
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def baseline_copy(finished, tmp_path):
    """A copy of the finished run to write baseline manifests into."""
    _, run_dir, _ = finished
    target = tmp_path / "baseline"
    shutil.copytree(run_dir, target)
    return target, json.loads((target / "manifest.json").read_text())


def write_manifest(directory: Path, manifest: dict, name: str) -> str:
    path = directory / name
    path.write_text(json.dumps(manifest))
    return str(path)


def test_an_accepted_manifest_is_a_baseline(baseline_copy, tiny_config, tmp_path, tiny_model_dir):
    directory, manifest = baseline_copy
    accepted = copy.deepcopy(manifest)
    accepted["decision"] = "accept"
    path = write_manifest(directory, accepted, "accepted.json")
    config = tiny_config(tmp_path, f"baseline_manifest={json.dumps(path)}",
                         out=str(tmp_path / "next"))
    admission = pipeline.admit(config)
    assert Path(admission.adapter) == (directory / "adapter").resolve()
    assert admission.model_spec == str(tiny_model_dir)
    assert not (tmp_path / "next").exists()
    # The baseline loaded from the manifest is the policy the first run delivered.
    baseline = load_policy(dataclasses.replace(config, model=admission.model_spec),
                           adapter=admission.adapter)
    assert baseline.baseline_version == manifest["new_policy_version"]


@pytest.mark.parametrize("change, message", [
    ({"decision": "tune"}, "only an accepted policy"),
    ({"decision": "accept", "adapter.sha256": "0" * 64}, "hashes to"),
    ({"decision": "accept", "adapter.path": "../../etc"}, "escapes"),
])
def test_bad_baseline_manifests_are_refused(baseline_copy, tiny_config, tmp_path, change, message):
    directory, manifest = baseline_copy
    bad = copy.deepcopy(manifest)
    for key, value in change.items():
        if key.startswith("adapter."):
            bad["adapter"][key.split(".", 1)[1]] = value
        else:
            bad[key] = value
    path = write_manifest(directory, bad, "bad.json")
    config = tiny_config(tmp_path, f"baseline_manifest={json.dumps(path)}",
                         out=str(tmp_path / "next"))
    with pytest.raises(InputError, match=message):
        pipeline.admit(config)
    assert not (tmp_path / "next").exists()


@needs_gsm8k
def test_dry_run_of_the_reference_profile_creates_nothing(tmp_path, monkeypatch,
                                                          tiny_model_dir):
    """The profile's hub id resolves offline from a Hugging Face cache that holds it (here the
    tiny model under that id) and is pinned to the cached commit."""
    from huggingface_hub import constants

    from helpers import hub_cache

    commit = hub_cache(tiny_model_dir, tmp_path / "hub", "Qwen/Qwen2.5-0.5B-Instruct",
                       config_changes={"max_position_embeddings": 32768})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    config = load_config("gsm8k_qwen05b", overrides=[f"task.path={json.dumps(str(GSM8K_DIR))}"],
                         device="cpu")
    report = admission.dry_run(config)
    assert report["train_prompts"] == 24 and report["eval_prompts"] == 12
    assert report["verifier"] == "gsm8k-final-number-v1"
    assert report["steps"] == 1
    assert (report["model"]["location"], report["model"]["revision"]) == (
        "Qwen/Qwen2.5-0.5B-Instruct", commit)
    assert list(work.iterdir()) == []


def test_a_manifest_naming_another_base_model_identity_is_refused_after_loading(
        baseline_copy, tiny_config, tmp_path):
    """Consistent on paper (the version recomputed from a forged model.sha256 and the real
    adapter), but the base model that loads under that name is another one: refused before
    anything is written."""
    from grpogate.files import policy_version, safetensors_sha256

    directory, manifest = baseline_copy
    forged = copy.deepcopy(manifest)
    forged["decision"] = "accept"
    forged["model"]["sha256"] = "e" * 64
    forged["new_policy_version"] = policy_version(
        "e" * 64, safetensors_sha256(directory / "adapter" / "adapter_model.safetensors"))
    path = write_manifest(directory, forged, "forged.json")
    config = tiny_config(tmp_path, f"baseline_manifest={json.dumps(path)}",
                         out=str(tmp_path / "next"))
    with pytest.raises(InputError, match="the loaded baseline is policy .* not the manifest's "
                                         "new_policy_version"):
        pipeline.run(config)
    assert not (tmp_path / "next").exists()


@pytest.mark.parametrize("enabled_before", [True, False])
@pytest.mark.parametrize("fails", [False, True])
def test_loading_runs_with_the_collector_paused_and_freezes_what_it_built(
        monkeypatch, enabled_before, fails):
    """Loading builds about 0.5 M objects that live for the whole run: no collector pass
    during it, they are frozen after it (also when it fails), and the collector's on/off state
    is the caller's again."""
    import gc

    seen = {}

    def fake_prepare(_admission):
        seen["enabled"] = gc.isenabled()
        seen["built"] = [[index] for index in range(1000)]  # tracked objects to freeze
        if fails:
            raise InputError("bad input")
        return "prepared"

    monkeypatch.setattr(pipeline, "prepare", fake_prepare)
    was = gc.isenabled()
    (gc.enable if enabled_before else gc.disable)()
    gc.unfreeze()
    try:
        if fails:
            with pytest.raises(InputError):
                pipeline.prepare_uncollected(None)
        else:
            assert pipeline.prepare_uncollected(None) == "prepared"
        assert seen["enabled"] is False
        assert gc.isenabled() is enabled_before
        assert gc.get_freeze_count() >= 1000 + 1  # the lists built and the list holding them
    finally:
        gc.unfreeze()
        (gc.enable if was else gc.disable)()


def test_what_loading_froze_is_handed_back_when_loading_fails(tiny_config, tmp_path, monkeypatch):
    """prepare_uncollected freezes the objects loading built; a load that raises still leaves
    nothing frozen in the caller's process once run() returns."""
    import gc

    def failing_prepare(_admission):
        raise InputError("the load failed")

    monkeypatch.setattr(pipeline, "prepare", failing_prepare)
    gc.unfreeze()
    with pytest.raises(InputError, match="the load failed"):
        pipeline.run(tiny_config(tmp_path))
    assert gc.get_freeze_count() == 0
    assert not (tmp_path / "run").exists()
