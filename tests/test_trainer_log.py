"""A TRL run's log and output directory, read without torch: the arithmetic of the rollout
figures (hand-computed), the decision rows of a gated foreign run, and every malformed
directory refused with one error naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from grpogate.config import Gates
from grpogate.errors import InputError
from grpogate.evidence import decisions
from grpogate.evidence.trainer_log import log_steps, rollout_from_log, update_from_log
from grpogate.inputs.trl_output import read_trl_output, trl_settings

GATES = vars(Gates())


def entry(step, frac, clipped, reward, **extra):
    return {"step": step, "loss": 0.0, "frac_reward_zero_std": frac,
            "completions/clipped_ratio": clipped, "reward": reward,
            "completions/mean_length": 10.0, "num_tokens": 100.0 * step, "step_time": 2.0,
            "clip_ratio/region_mean": 0.0, **extra}


def trainer_state(entries, global_step, runtime=None, batch=8):
    history = list(entries)
    if runtime is not None:
        history.append({"step": global_step, "train_runtime": runtime, "train_loss": 0.0})
    return {"global_step": global_step, "train_batch_size": batch, "log_history": history}


SETTINGS = {"num_generations": 4, "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 1, "num_iterations": 1, "num_processes": 1,
            "scale_rewards": "group", "multi_objective_aggregation": "sum_then_normalize"}


def test_valid_groups_truncation_and_throughput_by_hand():
    # 8 completions per step / G = 4 -> 2 groups per step. Valid = (1 - frac) x 2:
    # step 1: 0.5 -> 1, step 2: 0.0 -> 2, step 3: 1.0 -> 0; 6 groups, 3 valid, ratio 3/6 = 0.5,
    # effective trajectories 3 x 4 = 12; train_runtime 6 s -> 12 / 6 = 2.0 per second.
    # Truncation: (0.25 x 8 + 0.5 x 8 + 0 x 8) / 24 = 6 / 24 = 0.25.
    state = trainer_state([entry(1, 0.5, 0.25, 0.5, kl=0.01), entry(2, 0.0, 0.5, 0.25, kl=0.03),
                           entry(3, 1.0, 0.0, 0.0, kl=0.02)], 3, runtime=6.0)
    steps = log_steps(state, SETTINGS, "trainer_state.json")
    assert [s["valid_group_count"] for s in steps] == [1, 2, 0]
    assert [s["step"] for s in steps] == [0, 1, 2] and [s["trl_step"] for s in steps] == [1, 2, 3]
    assert [s["tokens"] for s in steps] == [100.0, 100.0, 100.0]  # num_tokens is cumulative
    rollout = rollout_from_log(steps, state, 4)
    assert (rollout["group_count"], rollout["valid_group_count"]) == (6, 3)
    assert rollout["max_length_hit_ratio"] == 0.25
    assert rollout["mean_reward"] == pytest.approx((0.5 + 0.25 + 0.0) / 3)
    assert rollout["rollout_seconds"] == 6.0 and rollout["seconds_source"] == "train_runtime"
    assert rollout["generated_tokens"] == 3 * 10 * 8
    update = update_from_log(steps, state, SETTINGS)
    assert update["update_count"] == 3 and update["mean_kl"] == pytest.approx(0.02)  # (1+3+2)/3 %
    result = decisions.evaluate_grpo_candidate(
        {"status": "ok", "rollout": rollout, "update": update, "resources": {},
         "comparison": {}}, GATES)
    assert result["valid_group_ratio"] == 0.5 and result["effective_trajectory_count"] == 12
    assert result["effective_trajectories_per_second"] == 2.0


def test_without_train_runtime_the_step_times_are_summed():
    # logging_steps = 2: one entry covers steps 1-2 (4 groups), its step_time the mean of two
    # steps, so the run's seconds are 2.0 x 2 = 4.0; valid = (1 - 0.25) x 4 = 3.
    state = trainer_state([entry(2, 0.25, 0.0, 0.5)], 2)
    steps = log_steps(state, SETTINGS, "trainer_state.json")
    assert steps[0]["group_count"] == 4 and steps[0]["valid_group_count"] == 3
    assert rollout_from_log(steps, state, 4)["rollout_seconds"] == 4.0


def test_num_iterations_counts_one_generation_per_two_steps():
    # num_iterations = 2: generations at steps 1 and 3 only; the entries of steps 2 and 4 log
    # no frac_reward_zero_std and add no group. Groups: 2 + 2 = 4, valid 2 + 1 = 3.
    settings = {**SETTINGS, "num_iterations": 2}
    entries = [entry(1, 0.0, 0.0, 0.5), {"step": 2, "loss": 0.1}, entry(3, 0.5, 0.0, 0.5),
               {"step": 4, "loss": 0.1}]
    steps = log_steps(trainer_state(entries, 4), settings, "t")
    assert [s["group_count"] for s in steps] == [2, 0, 2, 0]
    assert [s["valid_group_count"] for s in steps] == [2, 0, 1, 0]


def test_settings_that_do_not_match_the_log_are_refused():
    # 2 groups per step cannot have 1/3 of them with zero variance: the declared G is wrong.
    state = trainer_state([entry(1, 1 / 3, 0.0, 0.5)], 1)
    with pytest.raises(InputError, match="not a whole number"):
        log_steps(state, SETTINGS, "trainer_state.json")
    with pytest.raises(InputError, match="not a multiple of num_generations"):
        log_steps(state, {**SETTINGS, "num_generations": 3}, "t")
    with pytest.raises(InputError, match="does not count groups"):
        log_steps(state, {**SETTINGS, "scale_rewards": "batch"}, "t")


def test_zero_valid_groups_or_zero_updates_rejects():
    state = trainer_state([entry(1, 1.0, 0.0, 0.0)], 1, runtime=1.0)
    steps = log_steps(state, SETTINGS, "t")
    rollout, update = rollout_from_log(steps, state, 4), update_from_log(steps, state, SETTINGS)
    from grpogate.evidence.assemble import run_status

    assert run_status("ok", rollout, update) == "no_effective_update"
    evidence = {"status": "no_effective_update", "rollout": rollout, "update": update,
                "contract": {"admitted": True}}
    assert decisions.decide_run(evidence, GATES)["decision"] == "reject"


def admission(matches: bool, checked: bool) -> dict:
    return {"baseline_identity": {"matches": matches},
            "isolation": {"checked": checked, "shared_prompts": 0 if checked else None}}


def test_foreign_admission_rows():
    rows = {r["name"]: r for r in decisions.run_checks(
        {"foreign": {"admission": admission(False, False)}}, GATES)}
    assert rows["baseline_identity"]["passed"] is False and rows["baseline_identity"]["on_fail"] == "reject"
    assert rows["isolation"]["value"] == "not checked" and rows["isolation"]["on_fail"] == "tune"
    rows = {r["name"]: r for r in decisions.run_checks(
        {"foreign": {"admission": admission(True, True)}}, GATES)}
    assert rows["baseline_identity"]["passed"] and rows["isolation"]["passed"]
    assert "isolation" not in {r["name"] for r in decisions.run_checks({}, GATES)}


# --- the directory ------------------------------------------------------------------------------

def adapter_dir(directory: Path, base: str = "some/base") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"base_model.model.x.lora_A.weight": np.zeros((2, 3), dtype=np.float32)},
              str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"base_model_name_or_path": base, "peft_type": "LORA", "r": 2}))
    (directory / "trainer_state.json").write_text(json.dumps(trainer_state([], 0)))
    return directory


def test_a_good_directory_and_its_newest_checkpoint(tmp_path):
    found = read_trl_output(adapter_dir(tmp_path / "out"))
    assert found.base_model_name == "some/base" and found.pickles_not_loaded == []
    adapter_dir(tmp_path / "ckpt" / "checkpoint-2")
    adapter_dir(tmp_path / "ckpt" / "checkpoint-10", base="newest")
    (tmp_path / "ckpt" / "checkpoint-10" / "training_args.bin").write_bytes(b"\x80\x04.")
    found = read_trl_output(tmp_path / "ckpt")
    assert found.adapter_dir.name == "checkpoint-10" and found.base_model_name == "newest"
    assert found.pickles_not_loaded == ["checkpoint-10/training_args.bin"]
    assert trl_settings(found, {"num_generations": 4}, "f")["per_device_train_batch_size"] == 8
    with pytest.raises(InputError, match="num_generations must be a whole number"):
        trl_settings(found, {}, "--num-generations")
    declared = {"num_generations": 4, "output_dir": "/x", "beta": 0.0}
    assert "output_dir" not in trl_settings(found, declared, "f")  # recorded settings only
    with pytest.raises(InputError, match="steps_per_generation=2 differs"):
        trl_settings(found, {"num_generations": 4, "steps_per_generation": 2}, "f")


@pytest.mark.parametrize("damage, message", [
    ("no_adapter", "no adapter_config.json"),
    ("truncated", "truncated"),
    ("state_not_json", r"trainer_state.json:1: not valid JSON"),
    ("pickle_only", "only pickles"),
    ("full_weights", "full model weights"),
    ("bin_adapter", "adapter_model.bin is a pickle"),
])
def test_malformed_directories_are_refused(tmp_path, damage, message):
    out = adapter_dir(tmp_path / "out")
    weights = out / "adapter_model.safetensors"
    if damage in ("no_adapter", "pickle_only", "full_weights"):
        for name in ("adapter_config.json", "adapter_model.safetensors", "trainer_state.json"):
            (out / name).unlink()
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-5])
    elif damage == "state_not_json":
        (out / "trainer_state.json").write_text("{not json")
    elif damage == "pickle_only":
        (out / "training_args.bin").write_bytes(b"\x80\x04.")
    elif damage == "full_weights":
        (out / "config.json").write_text("{}")
        save_file({"w": np.zeros(1, dtype=np.float32)}, str(out / "model.safetensors"))
    elif damage == "bin_adapter":
        weights.unlink()
        (out / "adapter_model.bin").write_bytes(b"\x80\x04.")
    with pytest.raises(InputError, match=message):
        read_trl_output(out)
