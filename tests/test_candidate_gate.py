"""`grpogate gate --candidate DIR`: a candidate from any trainer, without its log.

The candidates are real files made by the libraries users use, on the tiny model: a PEFT
adapter saved by `PeftModel.save_pretrained`, the same adapter merged into a full checkpoint by
`merge_and_unload().save_pretrained(...)` (one file, and sharded by max_shard_size). Each is
gated end to end through the CLI and re-checked by `decide` (and `--replay`). Bad candidates
(pickle weights only, another architecture, shape or dtype, neither config file, both --from-trl
and --candidate, a shard outside the folder, a file past a checkpoint file's bound) are refused with
one `error:` line, exit 2, nothing written: those whose files could cost memory or run code in a
fresh interpreter under a memory cap and a timeout, the small and merely wrong ones (another
architecture, shape or dtype; both doors) in this process. Expected identities are computed
here by hand from the files' bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import TINY_SIZES
from helpers import sha256
from test_bounded_work import GiB, grpogate_cli, one_error
from test_trl_gate import planted_pickle
from typer.testing import CliRunner

from grpogate.cli import app

NOT_RECORDED = ("effective_groups", "effective_throughput", "updates", "truncation")


def tiny_sets() -> list[str]:
    return sum((["--set", f"{key}={json.dumps(value)}"] for key, value in TINY_SIZES.items()), [])


def gate_args(candidate, baseline, out, *extra) -> list[str]:
    return ["gate", "--profile", "smoke", "--candidate", str(candidate), "--baseline",
            str(baseline), "--out", str(out), *map(str, extra), *tiny_sets()]


def gate(*args):
    return CliRunner().invoke(app, gate_args(*args))


@pytest.fixture(scope="module")
def made(tiny_model_dir, tmp_path_factory) -> Path:
    """adapter/ (PeftModel.save_pretrained: a LoRA on every linear layer with B drawn away from
    zero, as after training), full/ and sharded/ (the same LoRA merged into the tiny model by
    merge_and_unload, saved by save_pretrained as one file and in shards of 4 MB)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("candidates")
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                  task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
    peft_model.save_pretrained(root / "adapter")
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(root / "full")
    merged.save_pretrained(root / "sharded", max_shard_size="4MB")
    return root


def version_by_hand(base_sha256: str, adapter_identity: str | None) -> str:
    """A policy version: sha256 of "<base identity>\\n<adapter identity, or none>"."""
    return hashlib.sha256(f"{base_sha256}\n{adapter_identity or 'none'}".encode()).hexdigest()


def checkpoint_identity_by_hand(directory: Path) -> str:
    """sha256 over the sorted "name:sha256\\n" lines of config.json and the weight files."""
    names = sorted(["config.json"] + [p.name for p in directory.glob("*.safetensors")])
    return hashlib.sha256("".join(f"{n}:{sha256(directory / n)}\n" for n in names).encode()
                          ).hexdigest()


def checks(evidence: dict) -> dict:
    return {row["name"]: row for row in evidence["decision"]["checks"]}


def candidate_completions(run_dir: Path) -> list[tuple]:
    return [(r["prompt_id"], r["sample_index"], r["completion"])
            for r in map(json.loads, (run_dir / "eval_completions.jsonl").open())
            if r["policy"] == "candidate"]


def assert_rechecked(run_dir: Path) -> None:
    decided = CliRunner().invoke(app, ["decide", str(run_dir)])
    assert decided.exit_code == 0 and "agrees" in decided.output, decided.output
    assert "came without its trainer's log" in " ".join(decided.output.split())
    replayed = CliRunner().invoke(app, ["decide", str(run_dir), "--replay", "2"])
    assert replayed.exit_code == 0, replayed.output
    # --replay 2 rounds up to the decode batch: all 4 eval prompts x 2 samples x 2 policies
    assert "16/16 completions equal" in replayed.output, replayed.output


def assert_gated_without_a_log(result, run_dir: Path, kind: str) -> dict:
    assert result.exit_code == 0, result.output
    assert "decision: " in result.output and "rollout figures: not recorded" in result.output
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert evidence["foreign"]["candidate_kind"] == kind
    assert evidence["foreign"]["trainer_state_sha256"] is None
    assert evidence["rollout"]["source"] == "not_recorded" and "steps" not in checks(evidence)
    for name in NOT_RECORDED:  # the training side says so, and the decision rests elsewhere
        assert checks(evidence)[name]["value"] == "not recorded"
        assert checks(evidence)[name]["passed"] is True
    assert not (run_dir / "trainer_state.json").exists()
    # isolation against the config's train split; the re-test, guard and KL as a run's
    assert checks(evidence)["isolation"]["passed"] is True
    assert "guard" in checks(evidence) and "retest_kl" in checks(evidence)
    assert evidence["comparison"]["drift"]["kl_to_baseline"] > 0
    # Every look of the sequential re-test is recorded, where it stopped and the completions it
    # drew: 2 policies x (eval prompts x eval_group_size + guard samples), as a run's evidence.
    retest = evidence["retest"]
    assert retest["stopped_at_look"] == len(retest["looks"]) >= 1
    config = evidence["config"]
    assert retest["completions"] == 2 * (retest["eval_prompts"] * config["eval_group_size"]
                                         + retest["guard_samples"])
    assert retest["eval_prompts"] * config["eval_group_size"] * 2 == len(
        (run_dir / "eval_completions.jsonl").read_text().splitlines())
    assert evidence["decision"]["decision"] in result.output
    return evidence


def test_a_peft_adapter_saved_by_peft_is_gated_and_rechecked(made, tiny_model_dir, tmp_path):
    adapter = Path(shutil.copytree(made / "adapter", tmp_path / "adapter"))
    (adapter / "adapter_model.bin").write_bytes(planted_pickle(tmp_path / "unpickled"))
    run_dir = tmp_path / "gated"
    result = gate(adapter, tiny_model_dir, run_dir, "--train-from-config")
    evidence = assert_gated_without_a_log(result, run_dir, "peft_adapter")
    assert evidence["foreign"]["pickles_not_loaded"] == ["adapter_model.bin"]
    assert not (tmp_path / "unpickled").exists()
    assert evidence["foreign"]["admission"]["baseline_identity"]["matches"] is True
    weights = adapter / "adapter_model.safetensors"
    assert evidence["artifact"]["sha256"] == sha256(weights) == sha256(
        run_dir / "adapter" / "adapter_model.safetensors")
    from grpogate.files import safetensors_sha256  # the tensors' identity rule (test_policy.py)

    base = evidence["inputs"]["model"]["sha256"]
    assert evidence["artifact"]["new_policy_version"] == version_by_hand(
        base, safetensors_sha256(weights))
    assert evidence["inputs"]["baseline_policy_version"] == version_by_hand(base, None)
    assert_rechecked(run_dir)


@pytest.mark.parametrize("folder", ["full", "sharded"])
def test_a_merged_checkpoint_is_gated_as_its_adapter_and_rechecked(folder, made, tiny_model_dir,
                                                                  tmp_path):
    """The merged checkpoint computes the adapter's function: on the same seeds its re-test
    completions are the adapter's, under its own identity (its files', as a --model DIR run
    would record its baseline)."""
    checkpoint = made / folder
    files = sorted(p.name for p in checkpoint.glob("*.safetensors"))
    assert (len(files) > 1) is (folder == "sharded")
    assert (checkpoint / "model.safetensors.index.json").is_file() is (folder == "sharded")
    run_dir = tmp_path / "gated"
    evidence = assert_gated_without_a_log(
        gate(checkpoint, tiny_model_dir, run_dir, "--train-from-config"), run_dir,
        "full_checkpoint")
    identity = checkpoint_identity_by_hand(checkpoint)
    assert evidence["artifact"]["path"] == "candidate"
    assert evidence["artifact"]["sha256"] == identity == checkpoint_identity_by_hand(
        run_dir / "candidate")
    assert evidence["artifact"]["new_policy_version"] == version_by_hand(identity, None)
    from grpogate.inputs.model_cache import directory_weights_sha256

    assert identity == directory_weights_sha256(checkpoint)
    assert sorted(p.name for p in (run_dir / "candidate").iterdir()) == sorted(
        ["config.json", *files] + (["model.safetensors.index.json"] if len(files) > 1 else []))
    adapter_run = tmp_path / "adapter-gated"
    assert gate(made / "adapter", tiny_model_dir, adapter_run).exit_code == 0
    assert candidate_completions(run_dir) == candidate_completions(adapter_run)
    assert_rechecked(run_dir)
    # A forged copy: its config changed and the manifest's hash of it redone is still named,
    # because the identity is recomputed from the files themselves.
    forged = Path(shutil.copytree(run_dir, tmp_path / "forged"))
    config = forged / "candidate" / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    manifest = json.loads((forged / "manifest.json").read_text())
    manifest["files"]["candidate/config.json"] = sha256(config)
    (forged / "manifest.json").write_text(json.dumps(manifest))
    refused = CliRunner().invoke(app, ["decide", str(forged)])
    assert refused.exit_code == 4 and "artifact.sha256" in refused.output, refused.output


def test_a_zero_b_adapter_is_rejected_as_no_effective_update(made, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    zero = Path(shutil.copytree(made / "adapter", tmp_path / "zero"))
    weights = zero / "adapter_model.safetensors"
    save_file({name: (tensor.zero_() if "lora_B" in name else tensor)
               for name, tensor in load_file(weights).items()}, weights)
    run_dir = tmp_path / "gated"
    result = gate(zero, tiny_model_dir, run_dir, "--train-from-config",
                  "--exit-code-from-decision")
    assert result.exit_code == 4, result.output
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert evidence["status"] == "no_effective_update"
    assert evidence["decision"]["decision"] == "reject"
    assert "effective_update" in evidence["decision"]["failed_checks"]
    assert "LoRA B matrices are all zero" in " ".join(result.output.split())
    assert CliRunner().invoke(app, ["decide", str(run_dir)]).exit_code == 0


def test_a_dataset_task_without_training_prompts_is_never_accept_and_replays(made, tiny_model_dir,
                                                                            tmp_path):
    """A user's own table as the task (`--task dataset:`), no training prompts named: isolation
    is "not checked" (so no accept), problems.jsonl holds no train set, and decide --replay
    re-samples the eval set from it."""
    pytest.importorskip("datasets", reason="needs the hf extra (pip install 'grpogate[hf]')")
    table = tmp_path / "sums.jsonl"
    table.write_text("".join(json.dumps({"prompt": f"What is {k} + {k + 3}?", "answer": 2 * k + 3})
                             + "\n" for k in range(40)))
    run_dir = tmp_path / "gated"
    result = gate(made / "full", tiny_model_dir, run_dir, "--task", f"dataset:{table}")
    assert result.exit_code == 0 and "isolation not checked" in result.output, result.output
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert evidence["decision"]["decision"] != "accept"
    assert "isolation" in evidence["decision"]["failed_checks"]
    splits = [json.loads(line)["split"] for line in (run_dir / "problems.jsonl").open()]
    assert "train" not in splits and splits.count("eval") == TINY_SIZES["eval_prompts"]
    assert_rechecked(run_dir)


# --- refusals: one error line, exit 2, nothing written ---------------------------------------

def refused(candidate, tiny_model_dir, out: Path, *extra) -> str:
    """The CLI on `candidate` in a fresh interpreter (4 GiB address space: torch and the tiny
    model fit; 120 s); its one error line."""
    line = one_error(grpogate_cli(*gate_args(candidate, tiny_model_dir, out, *extra),
                                  cap=4 * GiB, timeout=120))
    assert not out.exists()
    return line


def refused_here(candidate, tiny_model_dir, out: Path, *extra) -> str:
    """`refused` in this process, for candidates that are small and merely wrong (another
    architecture, shape or dtype; a usage error): nothing in them needs a memory cap, and a
    fresh interpreter spends about 5 s on imports and the baseline's load per case. The same
    checks: exit 2, no traceback, nothing on stdout, one `error:` line, nothing written."""
    result = gate(candidate, tiny_model_dir, out, *extra)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        repr(result.exception), result.output)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and result.stdout.strip() == "", result.output
    assert not out.exists()
    return lines[0]


def checkpoint_copy(made: Path, tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(made / "full", tmp_path / name))


def test_pickle_weights_and_a_folder_without_a_config_are_refused(made, tiny_model_dir,
                                                                  tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copyfile(made / "full" / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(planted_pickle(tmp_path / "unpickled"))
    assert "only pickle weights (pytorch_model.bin), which are never loaded" in refused(
        pickled, tiny_model_dir, tmp_path / "out")
    assert not (tmp_path / "unpickled").exists()
    (pickled / "config.json").unlink()
    assert refused(pickled, tiny_model_dir, tmp_path / "out") == (
        f"error: {pickled}: neither adapter_config.json (a PEFT adapter) nor config.json (a "
        "Hugging Face checkpoint); its pytorch_model.bin (pickles) are never loaded")
    assert not (tmp_path / "unpickled").exists()


def test_both_doors_at_once_are_refused(made, tiny_model_dir, tmp_path):
    line = refused_here(made / "adapter", tiny_model_dir, tmp_path / "out", "--from-trl",
                        made / "adapter", "--num-generations", 4)
    assert line.startswith("error: gate: give exactly one of --from-trl DIR")
    # A TRL log's settings with no TRL log: refused, not ignored.
    line = refused_here(made / "adapter", tiny_model_dir, tmp_path / "out", "--num-generations",
                        4)
    assert line == ("error: gate: --trl-args and --num-generations describe a TRL run's log; "
                    "--candidate reads no log (use --from-trl for a TRL output directory)")


def test_a_header_safetensors_itself_refuses_is_one_error_line(made, tiny_model_dir, tmp_path):
    import struct

    # Non-string metadata: grpogate's own header reader skips __metadata__, safetensors' reader
    # refuses it (SafetensorError, no traceback wanted).
    odd = checkpoint_copy(made, tmp_path, "metadata")
    data = (odd / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size]) | {"__metadata__": {"a": 1}}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    (odd / "model.safetensors").write_bytes(
        struct.pack("<Q", len(encoded)) + encoded + data[8 + size:])
    assert refused(odd, tiny_model_dir, tmp_path / "out").startswith(
        f"error: {odd}/model.safetensors: not a safetensors file safetensors reads (")


def test_a_checkpoint_of_another_architecture_shape_or_dtype_is_refused(made, tiny_model_dir,
                                                                        tmp_path):
    from safetensors.torch import load_file, save_file

    other = checkpoint_copy(made, tmp_path, "layers")  # another config: one layer, not two
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 1}))
    assert refused_here(other, tiny_model_dir, tmp_path / "out") == (
        f'error: {other}/config.json: field "num_hidden_layers" is 1, the baseline\'s is 2; '
        "the re-test runs the baseline's architecture, so the checkpoint must be of it")
    qwen = checkpoint_copy(made, tmp_path, "qwen")
    (qwen / "config.json").write_text(json.dumps(config | {"model_type": "qwen2"}))
    assert f'{qwen}/config.json: field "model_type" is \'qwen2\'' in refused_here(
        qwen, tiny_model_dir, tmp_path / "out")
    shaped = checkpoint_copy(made, tmp_path, "shape")  # one tensor cut short, config as is
    tensors = load_file(shaped / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :100].contiguous()
    save_file(tensors, shaped / "model.safetensors", metadata={"format": "pt"})
    assert refused_here(shaped, tiny_model_dir, tmp_path / "out") == (
        f"error: {shaped}/model.safetensors: tensor '{name}' is float32 [64, 100], the "
        "baseline's is float32 [64, 128]")
    extra = checkpoint_copy(made, tmp_path, "extra")  # a tensor the architecture has not
    tensors = load_file(extra / "model.safetensors")
    save_file(tensors | {"model.layers.2.mlp.down_proj.weight": tensors[name].clone()},
              extra / "model.safetensors", metadata={"format": "pt"})
    assert refused_here(extra, tiny_model_dir, tmp_path / "out") == (
        f"error: {extra}/model.safetensors: tensor 'model.layers.2.mlp.down_proj.weight' is "
        "not one of the baseline's (1 such); another architecture?")
    half = checkpoint_copy(made, tmp_path, "bf16")  # another dtype: the baseline loads float32
    save_file({k: v.bfloat16() for k, v in load_file(half / "model.safetensors").items()},
              half / "model.safetensors", metadata={"format": "pt"})
    assert refused_here(half, tiny_model_dir, tmp_path / "out") == (
        f"error: {half}/model.safetensors: tensor 'model.embed_tokens.weight' is bfloat16 "
        "[49152, 64], the baseline's is float32 [49152, 64] (load the baseline with --dtype "
        "bfloat16)")


def test_shards_outside_the_folder_or_past_the_hashing_bound_are_refused(made, tiny_model_dir,
                                                                         tmp_path):
    outside = Path(shutil.copytree(made / "sharded", tmp_path / "outside"))
    index = json.loads((outside / "model.safetensors.index.json").read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = "../model.safetensors"
    (outside / "model.safetensors.index.json").write_text(json.dumps(index))
    assert refused(outside, tiny_model_dir, tmp_path / "out") == (
        f'error: {outside}/model.safetensors.index.json: field "weight_map" names '
        f"'../model.safetensors' for tensor {first!r}; a shard is a .safetensors file in this "
        "folder")
    huge = checkpoint_copy(made, tmp_path, "huge")  # sparse: no disk, one byte past 50 GiB
    os.truncate(huge / "model.safetensors", 50 * GiB + 1)
    assert refused(huge, tiny_model_dir, tmp_path / "out") == (
        f"error: {huge}/model.safetensors: 53687091201 bytes, over the 53687091200 a checkpoint "
        "file may hold (the Hub's own limit); save the checkpoint in smaller shards "
        "(save_pretrained max_shard_size)")
