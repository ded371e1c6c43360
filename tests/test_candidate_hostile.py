"""`grpogate gate --candidate` on what a stranger, or a diverged training run, hands it.

A candidate whose weights hold NaN or infinite values is not re-tested: it is decided `reject`
naming `finite_weights`, the run directory is complete and `decide` agrees. A candidate whose
weights are finite but whose re-test gives NaN or infinite values (logits that overflow) is
decided `reject` naming `finite_retest`, those values written as null. What is hashed is what
is loaded: the candidate is copied into the run as it is hashed, and a checkpoint of more than
4 GiB (sparse, no disk) goes through admission and that copy under a memory cap. Each case
runs the CLI in a fresh interpreter under a memory cap and a timeout; the counts are computed
here by hand from the tiny model's shapes (hidden 64, intermediate 128, 2 key-value heads of
16, 2 layers, tied embeddings).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import time
from pathlib import Path

import pytest
from test_bounded_work import GiB, capped, grpogate_cli, one_error
from test_candidate_gate import gate_args, made  # noqa: F401  (the module's candidates)

# Per layer, the output widths of q, k, v, o, gate, up, down: 64 + 32 + 32 + 64 + 128 + 128 + 64.
LAYER_OUTPUTS = 512
RANK = 4  # the `made` adapter's LoRA rank


def gated(candidate: Path, baseline: Path, out: Path, *extra):
    """The CLI in a fresh interpreter (4 GiB address space: torch and the tiny model fit;
    120 s), deciding with its exit code."""
    return grpogate_cli(*gate_args(candidate, baseline, out, "--train-from-config",
                                   "--exit-code-from-decision", *extra), cap=4 * GiB,
                        timeout=120)


def rows(evidence: dict) -> dict:
    return {row["name"]: row for row in evidence["decision"]["checks"]}


def assert_decide_agrees(run_dir: Path) -> None:
    decided = grpogate_cli("decide", run_dir, cap=4 * GiB, timeout=120)
    assert decided.returncode == 0, decided.stdout[-2000:] + decided.stderr[-2000:]
    assert "agrees with the run's own decision" in decided.stdout


def test_an_adapter_with_nan_lora_b_is_rejected_unretested(made, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    nan = Path(shutil.copytree(made / "adapter", tmp_path / "nan"))
    weights = nan / "adapter_model.safetensors"
    save_file({name: tensor.fill_(float("nan")) if "lora_B" in name else tensor
               for name, tensor in load_file(weights).items()}, weights)
    run_dir = tmp_path / "gated"
    result = gated(nan, tiny_model_dir, run_dir)
    assert result.returncode == 4, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    evidence = json.loads((run_dir / "evidence.json").read_text())
    finite = evidence["foreign"]["admission"]["finite_weights"]
    # 14 LoRA B matrices (7 projections x 2 layers) of [out, 4], every value NaN; 14 A finite.
    assert finite["tensors_checked"] == 28 and finite["non_finite_tensors"] == 14
    assert finite["non_finite_values"] == RANK * 2 * LAYER_OUTPUTS == 4096
    assert evidence["decision"]["decision"] == "reject"
    assert "finite_weights" in evidence["decision"]["failed_checks"]
    assert rows(evidence)["finite_weights"]["value"] == 14
    assert evidence["comparison"]["skipped"] is True  # never re-tested
    assert (run_dir / "manifest.json").is_file() and (run_dir / "adapter" / weights.name).is_file()
    assert "finite weights: 14 of 28 tensors hold NaN or infinite values (4096 values" in (
        " ".join(result.stdout.split()))
    assert not list(tmp_path.glob(".gated.candidate-*"))  # the staging folder moved in
    assert_decide_agrees(run_dir)


def test_a_checkpoint_with_a_nan_norm_and_an_inf_weight_is_rejected(made, tiny_model_dir,
                                                                      tmp_path):
    from safetensors.torch import load_file, save_file

    broken = Path(shutil.copytree(made / "full", tmp_path / "broken"))
    weights = broken / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"][:] = float("nan")  # 64 values
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("-inf")  # one value
    save_file(tensors, weights, metadata={"format": "pt"})
    run_dir = tmp_path / "gated"
    result = gated(broken, tiny_model_dir, run_dir)
    assert result.returncode == 4, result.stdout[-3000:] + result.stderr[-3000:]
    evidence = json.loads((run_dir / "evidence.json").read_text())
    finite = evidence["foreign"]["admission"]["finite_weights"]
    # 20 tensors: the embedding (tied to the head), 9 a layer, the final norm.
    assert (finite["tensors_checked"], finite["non_finite_tensors"],
            finite["non_finite_values"]) == (20, 2, 65)
    assert [entry["tensor"] for entry in finite["listed"]] == [
        "model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    assert evidence["decision"]["decision"] == "reject"
    assert evidence["contract"]["failed_checks"] == ["finite_weights"]
    assert_decide_agrees(run_dir)
    # decide reads the copy's values again: a copy made finite is a named mismatch.
    forged = Path(shutil.copytree(run_dir, tmp_path / "forged"))
    save_file(load_file(made / "full" / "model.safetensors"),
              forged / "candidate" / "model.safetensors", metadata={"format": "pt"})
    refused = grpogate_cli("decide", forged, cap=4 * GiB, timeout=120)
    assert refused.returncode == 4 and "foreign.admission.finite_weights" in refused.stdout


def test_a_re_test_with_overflowing_logits_is_rejected_its_values_null(made, tiny_model_dir,
                                                                         tmp_path):
    """Finite weights whose forward overflows (a final norm of 3e38): each candidate
    completion's entropy and KL are NaN, written as null, and finite_retest rejects."""
    from safetensors.torch import load_file, save_file

    loud = Path(shutil.copytree(made / "full", tmp_path / "loud"))
    tensors = load_file(loud / "model.safetensors")
    tensors["model.norm.weight"][:] = 3e38
    save_file(tensors, loud / "model.safetensors", metadata={"format": "pt"})
    run_dir = tmp_path / "gated"
    result = gated(loud, tiny_model_dir, run_dir)
    assert result.returncode == 4, result.stdout[-3000:] + result.stderr[-3000:]
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert evidence["foreign"]["admission"]["finite_weights"]["non_finite_tensors"] == 0
    drift = evidence["comparison"]["drift"]
    # 4 eval prompts x 2 samples of the candidate; the baseline's 8 are finite.
    assert drift["non_finite_completions"] == 8 and drift["kl_to_baseline"] is None
    assert rows(evidence)["finite_retest"] == {"name": "finite_retest", "value": 8,
                                               "threshold": 0, "passed": False,
                                               "on_fail": "reject"}
    assert evidence["decision"]["decision"] == "reject"
    records = [json.loads(line) for line in (run_dir / "eval_completions.jsonl").open()]
    candidate = [r for r in records if r["policy"] == "candidate"]
    assert all(r["kl_to_baseline"] is None and r["non_finite"] for r in candidate)
    assert all(r["entropy"] is not None and "non_finite" not in r
               for r in records if r["policy"] == "baseline")
    assert_decide_agrees(run_dir)


# The child's exit code, its stdout and stderr passed through, and its peak resident set (KiB)
# as the last line of stderr (`peak_and_rest` splits it off).
PEAK_AND_OUTPUT = ("import resource, subprocess, sys; child = subprocess.run([sys.executable] + "
                   "sys.argv[1:]); "
                   "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
                   "file=sys.stderr); sys.exit(child.returncode)")


def peak_and_rest(result) -> int:
    """The child's peak (KiB) from PEAK_AND_OUTPUT's last stderr line; `result.stderr` keeps the
    child's own lines."""
    *rest, peak = result.stderr.rstrip("\n").split("\n")
    result.stderr = "\n".join(rest)
    return int(peak)


def sparse_shard(path: Path, tensor: str, elements: int) -> int:
    """A safetensors file declaring one float32 tensor of `elements` values, all zero and
    sparse (no disk); returns its size."""
    header = json.dumps({tensor: {"dtype": "F32", "shape": [elements],
                                  "data_offsets": [0, 4 * elements]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(header)) + header)
        stream.truncate(8 + len(header) + 4 * elements)
    return 8 + len(header) + 4 * elements


def test_a_sharded_checkpoint_over_4_gib_is_copied_hashed_and_checked_in_bounded_memory(
        made, tiny_model_dir, tmp_path):
    """Three sparse shards of 1.75 GiB (5.25 GiB, what main refused at 1 GiB a file and 4 GiB
    in all) go through admission, the copy, its hash and the NaN scan with a peak resident set
    under 2 GiB; the refusal that follows is the architecture's (their tensors are not the tiny
    model's shapes), so no re-test runs and nothing is written. The address space is capped at
    12 GiB, not 4: safetensors maps a shard whole to read its tensors (address space, not
    memory), and the resident set is what the test bounds."""
    big = tmp_path / "big"
    big.mkdir()
    shutil.copyfile(made / "full" / "config.json", big / "config.json")
    names = ["model.embed_tokens.weight", "model.norm.weight",
             "model.layers.0.input_layernorm.weight"]
    weight_map = {}
    for number, tensor in enumerate(names, 1):
        shard = f"model-{number:05d}-of-00003.safetensors"
        sparse_shard(big / shard, tensor, 7 * (1 << 26))  # 7 x 2**26 x 4 bytes = 1.75 GiB
        weight_map[tensor] = shard
    (big / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    out = tmp_path / "out"
    started = time.perf_counter()
    result = capped("-c", PEAK_AND_OUTPUT, "-m", "grpogate", *gate_args(big, tiny_model_dir, out),
                    cap=12 * GiB, timeout=300)
    seconds = time.perf_counter() - started
    kib = peak_and_rest(result)
    assert one_error(result) == (f"error: {big}/model-00001-of-00003.safetensors: tensor "
                                 "'model.embed_tokens.weight' is float32 [469762048], the "
                                 "baseline's is float32 [49152, 64]")
    assert kib * 1024 < 2 * GiB, kib  # 5.25 GiB read a block at a time, never held
    print(f"5.25 GiB sparse checkpoint: exit 2, peak RSS {kib // 1024} MiB, {seconds:.1f} s")
    assert not out.exists() and not list(tmp_path.glob(".out.candidate-*"))


def test_the_copy_is_what_is_hashed_and_a_later_change_at_the_source_reaches_nothing(made,
                                                                                     tmp_path):
    from grpogate.inputs.candidate_dir import read_candidate, stage_candidate

    source = Path(shutil.copytree(made / "sharded", tmp_path / "source"))
    found = read_candidate(source)
    before = {name: hashlib.sha256((source / name).read_bytes()).hexdigest()
              for name in found.files}
    staging = tmp_path / "staging"
    staging.mkdir()
    copied, hashes = stage_candidate(found, staging)
    assert hashes == before and copied.directory == staging and copied.files == found.files
    for name in found.files:  # the copy holds the bytes hashed
        assert hashlib.sha256((staging / name).read_bytes()).hexdigest() == hashes[name]
    (source / found.weights[0]).write_bytes(b"changed")  # the source changes: the copy not
    assert hashlib.sha256((staging / found.weights[0]).read_bytes()).hexdigest() == before[
        found.weights[0]]


@pytest.mark.parametrize("dtype, raw, expected", [
    # 1.0, NaN, +inf, -inf, -2.0, 0.0 in each IEEE width: 3 non-finite values
    ("F32", struct.pack("<6f", 1.0, float("nan"), float("inf"), float("-inf"), -2.0, 0.0), 3),
    ("F64", struct.pack("<6d", 1.0, float("nan"), float("inf"), float("-inf"), -2.0, 0.0), 3),
    ("F16", struct.pack("<6e", 1.0, float("nan"), float("inf"), float("-inf"), -2.0, 0.0), 3),
    # bfloat16: the high halves of the float32 words above
    ("BF16", bytes.fromhex("803f" "c07f" "807f" "80ff" "00c0" "0000"), 3),
    # float8 E5M2: 1.0, NaN, +inf, -inf, -2.0, 0.0; E4M3FN has no infinity: 0x7f, 0xff are NaN
    ("F8_E5M2", bytes([0x3C, 0x7E, 0x7C, 0xFC, 0xC0, 0x00]), 3),
    ("F8_E4M3", bytes([0x38, 0x7F, 0xFF, 0x7E, 0xC0, 0x00]), 2),
    ("I32", struct.pack("<6i", -1, 0x7F800000, 0x7FC00000, 3, 4, 5), 0),  # integers: never
], ids=["F32", "F64", "F16", "BF16", "F8_E5M2", "F8_E4M3", "I32"])
def test_non_finite_values_are_counted_by_their_bits_in_every_float_width(dtype, raw, expected,
                                                                         tmp_path):
    from grpogate.files import non_finite_counts

    header = json.dumps({"t": {"dtype": dtype, "shape": [6], "data_offsets": [0, len(raw)]}})
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + raw)
    read, counts = non_finite_counts(path)
    assert (read, counts) == ((0, {}) if dtype == "I32" else (1, {"t": expected} if expected
                                                                 else {}))


# --- files a candidate names: bounded before anything reads them -------------------------------

def adapter_copy(made: Path, tmp_path: Path, change=None) -> Path:
    """A copy of the made adapter, its adapter_config.json changed by `change` (in place)."""
    adapter = Path(shutil.copytree(made / "adapter", tmp_path / "adapter"))
    if change is not None:
        config = json.loads((adapter / "adapter_config.json").read_text())
        change(config)
        (adapter / "adapter_config.json").write_text(json.dumps(config))
    return adapter


def test_400000_target_module_names_are_refused_before_peft(made, tiny_model_dir, tmp_path):
    """4.6 MB of plain names, under the JSON bound: PEFT would test every module against each
    (main: still running at 300 s)."""
    adapter = adapter_copy(made, tmp_path, lambda config: config.update(
        target_modules=[f"name_{k}" for k in range(400_000)]))
    started = time.perf_counter()
    line = one_error(grpogate_cli(*gate_args(adapter, tiny_model_dir, tmp_path / "out"),
                                  cap=4 * GiB, timeout=60))
    assert line == (f'error: {adapter}/adapter_config.json: field "target_modules" has 400000 '
                    "entries, over the 4096 grpogate lets PEFT match against every module (a "
                    "model's linear modules number a few hundred); list the module names once "
                    'each, or use target_modules "all-linear"')
    assert time.perf_counter() - started < 60 and not (tmp_path / "out").exists()


def test_a_rank_pattern_of_5000_keys_is_refused(made, tiny_model_dir, tmp_path):
    adapter = adapter_copy(made, tmp_path, lambda config: config.update(
        rank_pattern={f"layers.{k}.q_proj": 4 for k in range(5000)}))
    line = one_error(grpogate_cli(*gate_args(adapter, tiny_model_dir, tmp_path / "out"),
                                  cap=4 * GiB, timeout=60))
    assert line.startswith(f'error: {adapter}/adapter_config.json: field "rank_pattern" has '
                           "5000 entries, over the 4096")


def test_an_adapter_config_linked_to_etc_passwd_is_named_a_link(made, tiny_model_dir, tmp_path):
    adapter = adapter_copy(made, tmp_path)
    (adapter / "adapter_config.json").unlink()
    (adapter / "adapter_config.json").symlink_to("/etc/passwd")
    line = one_error(grpogate_cli(*gate_args(adapter, tiny_model_dir, tmp_path / "out"),
                                  cap=4 * GiB, timeout=60))
    assert line == (f"error: {adapter}/adapter_config.json: a symbolic link to a file outside "
                    "the candidate directory; grpogate reads no file outside it (copy the file "
                    "in its place)")  # and no byte of /etc/passwd


def test_a_named_base_model_folder_linking_to_dev_zero_is_not_hashed(made, tiny_model_dir,
                                                                     tmp_path):
    """The adapter names another folder as its base model: its model.safetensors is a link to
    /dev/zero (main: hashed for ever, killed at 150 s). Refused on the open descriptor, the
    folder does not match the baseline: `reject` naming baseline_identity."""
    named = tmp_path / "named"
    named.mkdir()
    shutil.copyfile(tiny_model_dir / "config.json", named / "config.json")
    (named / "model.safetensors").symlink_to("/dev/zero")
    adapter = adapter_copy(made, tmp_path, lambda config: config.update(
        base_model_name_or_path=str(named)))
    run_dir = tmp_path / "gated"
    result = gated(adapter, tiny_model_dir, run_dir)
    assert result.returncode == 4, result.stdout[-3000:] + result.stderr[-3000:]
    identity = json.loads((run_dir / "evidence.json").read_text())["foreign"]["admission"][
        "baseline_identity"]
    assert identity["matches"] is False
    assert identity["how"] == ("no match: the folder it names is not hashed "
                               f"({named}/model.safetensors: not a regular file (a folder, FIFO, "
                               "socket or device))")


DECIDE_HASH = """
import sys
from pathlib import Path
from grpogate.evidence.audit_files import Audit, _bound_hashing
run, name = Path(sys.argv[1]), sys.argv[2]
_bound_hashing(run, [name], None, "candidate/")
audit = Audit()
audit.shards = "candidate/"
print(audit.sha256(run, name))
"""


def test_decide_hashes_a_checkpoint_shard_past_a_run_files_bound_within_its_own(tmp_path):
    """What decide hashes of a gated checkpoint: a 1.25 GiB shard (main: over the 1 GiB a run
    file may hold) is budgeted and hashed a block at a time under a 1 GiB address space; outside
    a checkpoint's folder the same file is refused unread."""
    from grpogate.evidence.audit_files import _bound_hashing
    from grpogate.files import FileTooLarge

    (tmp_path / "candidate").mkdir()
    size = sparse_shard(tmp_path / "candidate" / "model-00001-of-00002.safetensors", "w",
                        5 * (1 << 26))  # 5 x 2**26 x 4 bytes = 1.25 GiB
    name = "candidate/model-00001-of-00002.safetensors"
    result = capped("-c", DECIDE_HASH, tmp_path, name, cap=GiB, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    digest = hashlib.sha256()
    with open(tmp_path / name, "rb") as stream:
        while block := stream.read(1 << 24):
            digest.update(block)
    assert result.stdout.split() == [digest.hexdigest()] and size > GiB
    with pytest.raises(FileTooLarge, match="over the limit of 1073741824 for a run file"):
        _bound_hashing(tmp_path, [name], None)


def test_shards_past_256_gib_in_all_are_refused_unread(made, tiny_model_dir, tmp_path):
    """Six sparse shards of 43 GiB, each within a file's 50 GiB: 258 GiB in all."""
    big = tmp_path / "big"
    big.mkdir()
    shutil.copyfile(made / "full" / "config.json", big / "config.json")
    weight_map, total = {}, 0
    for number in range(1, 7):
        shard = f"model-{number:05d}-of-00006.safetensors"
        total += sparse_shard(big / shard, f"t{number}", 43 * (1 << 28))  # 43 GiB
        weight_map[f"t{number}"] = shard
    (big / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    line = one_error(grpogate_cli(*gate_args(big, tiny_model_dir, tmp_path / "out"),
                                  cap=4 * GiB, timeout=60))
    assert line == (f"error: {big}: {total} bytes of weights, over the 274877906944 that "
                    "grpogate copies, hashes and decide re-hashes of a candidate")


def test_a_2_gib_adapter_is_refused_by_its_header_before_peft_reads_it(made, tiny_model_dir,
                                                                       tmp_path):
    """One 2 GiB tensor (sparse) under a LoRA's name (main: read whole, 2.5 GB peak): past 3x
    the tiny model's weights, refused before PEFT reads a byte."""
    adapter = adapter_copy(made, tmp_path)
    size = sparse_shard(adapter / "adapter_model.safetensors",
                        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", 1 << 29)
    out = tmp_path / "out"
    result = capped("-c", PEAK_AND_OUTPUT, "-m", "grpogate",
                    *gate_args(adapter, tiny_model_dir, out), cap=12 * GiB, timeout=120)
    kib = peak_and_rest(result)
    # The tiny model: embedding 49152 x 64, per layer 4096 + 2 x 2048 + 4096 + 3 x 8192 + 2 x 64
    # values, 2 layers, the final norm 64: 3,219,776 float32 values = 12,879,104 bytes.
    assert one_error(result) == (f"error: {adapter}/adapter_model.safetensors: {size} bytes, "
                                 "over 3 times its base model's 12879104 bytes of weights (a "
                                 "LoRA of rank up to a layer's width, with modules saved whole, "
                                 "holds at most that); not an adapter of this model")
    assert kib * 1024 < GiB, kib
    assert not out.exists()
