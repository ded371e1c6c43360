"""`grpogate gate --from-trl`: TRL's own GRPOTrainer trains the tiny model for two steps, and
its output directory is gated, audited, replayed, reported and signed; an adapter of another
base model is `reject`; a pickle-only directory is exit 2 with nothing unpickled; and a
grpogate run's own adapter, gated as a foreign PEFT directory, re-tests exactly as
`grpogate eval` / `compare` do."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from conftest import TINY_SIZES
from helpers import key_pair, sha256
from trl_style_rewards import parity_reward  # the same function grpogate runs (test_api.py)
from typer.testing import CliRunner

from grpogate.cli import app

GROUP_SIZE = 4


def tiny_sets() -> list[str]:
    return [f"{key}={json.dumps(value)}" for key, value in TINY_SIZES.items()]


@pytest.fixture(scope="module")
def trl_run(tiny_config, tmp_path_factory):
    """TRL 2 steps x 2 prompts x G = 4 on the tiny model over the tiny config's train split;
    returns (output_dir, train.jsonl, the reward batches TRL scored)."""
    trl = pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[bench]')")
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from grpogate.inputs import tasks

    root = tmp_path_factory.mktemp("trl")
    config = tiny_config(root)
    train, _, _, _ = tasks.load_problem_sets(config.task, config.train_prompts, config.eval_prompts)
    rows = [{"prompt": [{"role": "system", "content": config.resolved_system_prompt()},
                        {"role": "user", "content": p.question}], "reference": p.reference}
            for p in train]
    (root / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    batches = []

    def recorded_reward(prompts, completions, **kwargs):
        rewards = parity_reward(prompts, completions, **kwargs)
        batches.append(rewards)
        return rewards

    args = trl.GRPOConfig(
        output_dir=str(root / "out"), num_generations=GROUP_SIZE,
        per_device_train_batch_size=config.prompts_per_step * GROUP_SIZE, max_steps=2,
        max_completion_length=8, learning_rate=1e-3, logging_steps=1, report_to=[],
        use_cpu=True, bf16=False, save_strategy="steps", save_steps=1, seed=0,
        shuffle_dataset=False, disable_tqdm=True, model_init_kwargs={"dtype": "float32"})
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    trainer = trl.GRPOTrainer(
        model=config.model, reward_funcs=[recorded_reward], args=args,
        train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                               task_type="CAUSAL_LM"))
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    return root / "out", root / "train.jsonl", batches


def planted_pickle(marker: Path) -> bytes:
    """A pickle that creates `marker` when it is loaded (what training_args.bin could do)."""

    class Planted:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    return pickle.dumps(Planted())


def test_the_plant_is_live(tmp_path):
    proof = tmp_path / "proof"
    pickle.loads(planted_pickle(proof))
    assert proof.exists()


def gate(args: list[str]):
    return CliRunner().invoke(app, ["gate", "--profile", "smoke", *args, *sum(
        (["--set", s] for s in tiny_sets()), [])])


def test_a_trl_run_is_gated_audited_replayed_and_reported(trl_run, tiny_model_dir, tmp_path):
    out, train_data, batches = trl_run
    marker = tmp_path / "unpickled"
    (out / "training_args.bin").write_bytes(planted_pickle(marker))
    run_dir = tmp_path / "gated"
    result = gate(["--from-trl", str(out), "--num-generations", str(GROUP_SIZE),
                   "--baseline", str(tiny_model_dir), "--train-data", str(train_data),
                   "--out", str(run_dir)])
    assert result.exit_code == 0, result.output
    evidence = json.loads((run_dir / "evidence.json").read_text())
    rollout = evidence["rollout"]
    assert rollout["source"] == "trainer_log" and "cannot be re-derived" in rollout["source_note"]
    # Counted from the rewards TRL really gave: a group of G is valid when they differ.
    groups = [batch[k:k + GROUP_SIZE] for batch in batches for k in range(0, len(batch), GROUP_SIZE)]
    assert rollout["group_count"] == len(groups) == 4
    assert rollout["valid_group_count"] == sum(max(g) > min(g) for g in groups)
    assert evidence["update"]["update_count"] == 2
    assert rollout["seconds_source"] == "train_runtime"
    isolation = evidence["foreign"]["admission"]["isolation"]
    assert {key: isolation[key] for key in ("checked", "train_prompts", "shared_prompts",
                                            "source")} == {
        "checked": True, "train_prompts": 4, "shared_prompts": 0, "source": "--train-data"}
    assert evidence["artifact"]["sha256"] == sha256(out / "adapter_model.safetensors")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["files"]["trainer_state.json"] == sha256(out / "trainer_state.json")
    assert {r["policy"] for r in map(json.loads, (run_dir / "eval_completions.jsonl").open())} == {
        "baseline", "candidate"}
    # The re-test a grpogate run makes: the guard set (the smoke profile's) and the drift too.
    guard_records = [json.loads(line) for line in (run_dir / "guard_completions.jsonl").open()]
    guard = evidence["guard"]
    assert guard["enabled"] is True and "skipped" not in guard
    assert len(guard_records) == 2 * guard["prompts"] * guard["group_size"]
    assert manifest["files"]["guard_completions.jsonl"] == sha256(run_dir / "guard_completions.jsonl")
    assert [c["name"] for c in evidence["decision"]["checks"]].count("guard") == 1
    assert evidence["comparison"]["drift"]["kl_to_baseline"] >= 0
    assert (run_dir / "report.html").is_file()
    decided = CliRunner().invoke(app, ["decide", str(run_dir), "--replay", "2"])
    assert decided.exit_code == 0 and "agrees" in decided.output, decided.output
    assert "not re-checkable" in decided.output
    # --replay 2 rounds up to the decode batch: all 4 eval prompts x 2 samples x 2 policies
    assert "16/16 completions equal" in decided.output
    assert not marker.exists()
    # decide re-scores the guard records too: one forged reward is a named mismatch.
    forged = tmp_path / "forged"
    shutil.copytree(run_dir, forged)
    guard_records[0]["reward"] = 1.0 - guard_records[0]["reward"]
    (forged / "guard_completions.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in guard_records))
    refused = CliRunner().invoke(app, ["decide", str(forged)])
    assert refused.exit_code == 4 and "guard_completions.jsonl:1 reward" in refused.output, \
        refused.output
    if importlib.util.find_spec("model_signing") is not None:  # the signing extra
        private, public = key_pair(tmp_path)
        assert CliRunner().invoke(app, ["sign", str(run_dir), "--key", str(private)]).exit_code == 0
        verified = CliRunner().invoke(app, ["decide", str(run_dir), "--verify-key", str(public)])
        assert verified.exit_code == 0 and "run.sig verifies" in verified.output, verified.output
    # The log is pinned: one changed number in the copy is a named mismatch.
    state = json.loads((run_dir / "trainer_state.json").read_text())
    state["log_history"][0]["frac_reward_zero_std"] = 1.0
    (run_dir / "trainer_state.json").write_text(json.dumps(state))
    tampered = CliRunner().invoke(app, ["decide", str(run_dir)])
    assert tampered.exit_code == 4 and "trainer_state" in tampered.output
    # Past the size no real run writes (1 GiB; sparse, no disk) the log refuses the directory
    # (exit 2), as every run file does; it is not a mismatch to read on past.
    os.truncate(run_dir / "trainer_state.json", (1 << 30) + 1)
    oversized = CliRunner().invoke(app, ["decide", str(run_dir)])
    assert oversized.exit_code == 2, oversized.output
    assert "trainer_state.json" in oversized.output and "over the limit" in oversized.output


def test_an_adapter_of_another_base_model_is_rejected(trl_run, tiny_model_dir, tmp_path):
    out, _, _ = trl_run
    other = tmp_path / "other"
    shutil.copytree(out, other, ignore=shutil.ignore_patterns("checkpoint-*"))
    config = json.loads((other / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "some-org/another-model"
    (other / "adapter_config.json").write_text(json.dumps(config))
    run_dir = tmp_path / "gated"
    result = gate(["--from-trl", str(other), "--num-generations", str(GROUP_SIZE),
                   "--baseline", str(tiny_model_dir), "--out", str(run_dir),
                   "--exit-code-from-decision"])
    assert result.exit_code == 4, result.output
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert evidence["decision"]["decision"] == "reject"
    assert evidence["decision"]["failed_checks"][:2] == ["contract", "baseline_identity"]
    assert evidence["comparison"]["skipped"] is True
    assert CliRunner().invoke(app, ["decide", str(run_dir)]).exit_code == 0  # agrees: reject


def test_a_pickle_only_directory_is_exit_2_and_nothing_is_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    trl_dir = tmp_path / "out"
    trl_dir.mkdir()
    (trl_dir / "training_args.bin").write_bytes(planted_pickle(marker))
    result = gate(["--from-trl", str(trl_dir), "--num-generations", "4",
                   "--out", str(tmp_path / "gated")])
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "only pickles" in result.output
    assert not marker.exists() and not (tmp_path / "gated").exists()


def foreign_log(evidence: dict) -> dict:
    """What TRL's log would say of a grpogate run: per step the zero-std fraction
    (1 - valid ratio), clipped ratio and reward; the optimizer steps; the run's seconds."""
    steps = evidence["steps"]
    return {"global_step": evidence["update"]["update_count"],
            "train_batch_size": evidence["config"]["prompts_per_step"] * GROUP_SIZE,
            "log_history": [{"step": s["step"] + 1, "loss": 0.0,
                             "frac_reward_zero_std": 1.0 - s["valid_group_ratio"],
                             "completions/clipped_ratio": s["max_length_hit_ratio"],
                             "reward": s["mean_reward"]} for s in steps]
            + [{"step": len(steps), "train_runtime": evidence["rollout"]["rollout_seconds"]
                + evidence["update"]["update_seconds"]}]}


def test_a_grpogate_adapter_gated_as_foreign_retests_as_eval_and_compare(alternating_run,
                                                                         tiny_config, tmp_path):
    from grpogate.review.standalone_eval import compare_evaluations, evaluate_standalone
    from grpogate.trl_gate import GateRequest, gate as gate_run

    ran = alternating_run[2]  # conftest's run on the alternating reward
    assert ran["update"]["update_count"] > 0
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(Path(ran["run_dir"]) / "adapter" / name, foreign / name)
    (foreign / "trainer_state.json").write_text(json.dumps(foreign_log(ran)))
    config = tiny_config(tmp_path / "b")
    gated = gate_run(config, GateRequest(str(foreign), num_generations=GROUP_SIZE,
                                         train_from_config=True))
    assert gated["foreign"]["admission"]["baseline_identity"]["matches"] is True
    for key in ("group_count", "valid_group_count", "effective_trajectory_count"):
        assert gated["rollout"][key] == ran["rollout"][key], key
    seed = gated["seeds"]["eval"]
    documents = [evaluate_standalone(dataclasses.replace(config, adapter=adapter), "tiny", seed)
                 for adapter in ("", str(foreign))]
    stored = [json.loads(line) for line in (tmp_path / "b" / "run" / "eval_completions.jsonl").open()]
    for name, document in zip(("baseline", "candidate"), documents):
        assert [(r["prompt_id"], r["completion"], r["reward"]) for r in document["records"]] == [
            (r["prompt_id"], r["completion"], r["reward"]) for r in stored if r["policy"] == name]
        assert document["metrics"] == gated["comparison"][name]
    assert documents[1]["policy"]["policy_version"] == gated["artifact"]["new_policy_version"]
    paired = compare_evaluations(*documents, bootstrap_seed=config.seed)["paired"]
    assert paired == gated["comparison"]["paired"]
    # and the grpogate run's own re-test of the same adapter, on the same seeds
    assert gated["comparison"]["paired"] == ran["comparison"]["paired"]
    # isolation was checked against the config's train split, so nothing keeps it from accept
    # but the gates; `decide` re-checks the gated run from its files and agrees.
    assert gated["foreign"]["admission"]["isolation"]["checked"] is True
    from grpogate.evidence.foreign_audit import audit_any

    audit = audit_any(tmp_path / "b" / "run")
    assert audit["mismatches"] == [] and audit["agrees"] and "not_checkable" in audit


def test_an_adapter_with_zero_b_matrices_is_no_effective_update(trl_run, tiny_model_dir,
                                                               tmp_path):
    """A LoRA whose B matrices are all zero adds B A = 0: it computes the baseline's function
    under another adapter hash. Its re-test repeats the baseline's completions pair for pair
    (same seeds), so the gate rejects it as no effective update and says why, naming the B."""
    from safetensors.torch import load_file, save_file

    out, train_data, _ = trl_run
    zero = tmp_path / "zero"
    shutil.copytree(out, zero, ignore=shutil.ignore_patterns("checkpoint-*"))
    weights = zero / "adapter_model.safetensors"
    tensors = {name: (tensor.zero_() if "lora_B" in name else tensor)
               for name, tensor in load_file(weights).items()}
    save_file(tensors, weights)
    run_dir = tmp_path / "gated"
    result = gate(["--from-trl", str(zero), "--num-generations", str(GROUP_SIZE),
                   "--baseline", str(tiny_model_dir), "--train-data", str(train_data),
                   "--out", str(run_dir), "--exit-code-from-decision"])
    assert result.exit_code == 4, result.output
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert evidence["status"] == "no_effective_update"
    assert evidence["decision"]["decision"] == "reject"
    assert "effective_update" in evidence["decision"]["failed_checks"]
    counts = evidence["comparison"]["identical_completions"]
    assert counts["pairs"] == counts["identical"] > 0
    text = " ".join(result.output.split())
    assert "the candidate's re-test completions are identical to the baseline's" in text
    assert "LoRA B matrices are all zero, so it computes the baseline's function exactly" in text
    decided = CliRunner().invoke(app, ["decide", str(run_dir)])
    assert decided.exit_code == 0 and "agrees" in decided.output, decided.output
