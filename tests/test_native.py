"""The native kernels (the decode step's and the update's log-prob head): hand-computed
values, rows independent of their batch, the same logits and samples as the torch operations
they replace, and the torch path wherever the kernels do not build or do not apply."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import resource
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpogate.files import cache_dir
from grpogate.engines.cpu import native, native_build
from grpogate.engines import engine_for
from grpogate.engines.cpu import CpuEngine
from grpogate.engines.cpu.decoding import LeanStepper
from grpogate.engines.cpu.weights import lean_decoder
from grpogate.inputs.policy import load_policy, sampling_weights
from grpogate.sampling.rollout import SamplingSettings, generate_completions
from test_decoding import PROMPT_SETS, tiny

MASKED = -1e30
SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_rms_norm_and_silu_mul_by_hand(kernels):
    # x = [3, 4]: mean square (9 + 16) / 2 = 12.5, 1 / sqrt(12.5) = 0.2828427;
    # x * that = [0.8485281, 1.1313708], times weight [1, 2] -> [0.8485281, 2.2627417].
    x = torch.tensor([[3.0, 4.0]])
    weight = torch.tensor([1.0, 2.0])
    expected = torch.tensor([[0.8485281, 2.2627417]])
    torch.testing.assert_close(kernels.rms_norm(x, weight, 0.0), expected)
    # add_rms_norm: hidden [1, 2] + delta [2, 2] = [3, 4] in place, then the same norm.
    hidden = torch.tensor([[1.0, 2.0]])
    normed = kernels.add_rms_norm(hidden, torch.tensor([[2.0, 2.0]]), weight, 0.0)
    assert hidden.tolist() == [[3.0, 4.0]]
    torch.testing.assert_close(normed, expected)
    # silu(g) = g / (1 + e^-g): silu(0) = 0, silu(1) = 0.7310586, silu(-2) = -0.2384058;
    # times up [5, 2, 3] -> [0, 1.4621172, -0.7152175].
    gate_up = torch.tensor([[0.0, 1.0, -2.0, 5.0, 2.0, 3.0]])
    torch.testing.assert_close(kernels.silu_mul(gate_up),
                               torch.tensor([[0.0, 1.4621172, -0.7152175]]))


def _one_row_attention(kernels, prompt_keys, prompt_values, prompt_mask, qkv, cos, sin,
                       capacity=16, column=0, own=None):
    d = qkv.shape[1] // 3
    own_keys = torch.zeros(1, 1, d, capacity) if own is None else own[0]
    own_values = torch.zeros(1, 1, capacity, d) if own is None else own[1]
    out = kernels.decode_attention(
        qkv, cos, sin, torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), prompt_mask,
        prompt_keys,
        prompt_values, own_keys, own_values, column, heads=1, scale=1.0)
    return out, own_keys, own_values


def test_decode_attention_by_hand(kernels):
    """One row, one head, d = 16, no rotation (cos 1, sin 0), scale 1. The prompt's 16 columns:
    column 0 a zero key, column 1 the key e0, the rest masked; the row's own key is zero. With
    q = ln 3 e0 the scores are [0, ln 3] and 0 (own), so softmax = [1/5, 3/5, 1/5]; values 5 e1,
    5 e2 and 5 e3 give the output [0, 1, 3, 1, 0, ...]."""
    d = 16
    q, k, v = torch.zeros(d), torch.zeros(d), torch.zeros(d)
    q[0] = math.log(3.0)
    v[3] = 5.0
    qkv = torch.cat([q, k, v])[None]
    prompt_keys = torch.zeros(1, 1, d, 16)  # transposed: [d, span]
    prompt_keys[0, 0, 0, 1] = 1.0
    prompt_values = torch.zeros(1, 1, 16, d)
    prompt_values[0, 0, 0, 1] = 5.0
    prompt_values[0, 0, 1, 2] = 5.0
    prompt_mask = torch.full((1, 16), MASKED)
    prompt_mask[0, :2] = 0.0
    out, own_keys, own_values = _one_row_attention(
        kernels, prompt_keys, prompt_values, prompt_mask, qkv, torch.ones(4, d),
        torch.zeros(4, d))
    expected = torch.zeros(1, d)
    expected[0, 1:4] = torch.tensor([1.0, 3.0, 1.0])
    torch.testing.assert_close(out, expected)
    assert own_values[0, 0, 0].tolist() == v.tolist()  # the row's value written at column 0
    assert own_keys[0, 0, :, 0].tolist() == k.tolist()


def test_decode_attention_rotates_query_and_key_by_hand(kernels):
    """RoPE in halves: with cos 0 and sin 1 the rotation maps x to [-x_hi, x_lo]. The key
    e8 (d = 16) becomes -e0; the query e0 becomes e8. The stored key is the rotated one."""
    d = 16
    q, k = torch.zeros(d), torch.zeros(d)
    q[0], k[8] = 1.0, 1.0
    qkv = torch.cat([q, k, torch.zeros(d)])[None]
    _, own_keys, _ = _one_row_attention(
        kernels, torch.zeros(1, 1, d, 16), torch.zeros(1, 1, 16, d), torch.zeros(1, 16), qkv,
        torch.zeros(4, d), torch.ones(4, d))
    expected = torch.zeros(d)
    expected[0] = -1.0
    assert own_keys[0, 0, :, 0].tolist() == expected.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernels, dtype):
    """The same row computed in a batch of 24 rows and alone: bit-identical outputs (attention,
    norms, SiLU), which is what keeps a prompt's samples independent of its batch and rank.
    Alone, the row reads its own cache at its slot of the whole batch's (`slot_of_row`), or
    from a cache holding only its slot; it writes its key and value there alone."""
    generator = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, d, span, capacity, column = 24, 6, 2, 32, 32, 16, 5

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    qkv, cos, sin = rand(rows, (heads + 2 * kv_heads) * d), rand(64, d), rand(64, d)
    prompt_keys, prompt_values = rand(3, kv_heads, d, span), rand(3, kv_heads, span, d)
    prompt_mask = torch.zeros(3, span)
    prompt_mask[:, :7] = MASKED
    own_keys, own_values = rand(rows, kv_heads, d, capacity), rand(rows, kv_heads, capacity, d)
    positions = torch.randint(0, 64, (rows,), generator=generator)
    prompt_of_row = torch.arange(rows) // 8

    def attention(selected, keys, values, slots):
        return kernels.decode_attention(
            qkv[selected], cos, sin, positions[selected], prompt_of_row[selected], slots,
            prompt_mask, prompt_keys, prompt_values, keys, values, column, heads, 0.125)

    every = torch.arange(rows)
    batch_keys, batch_values = own_keys.clone(), own_values.clone()
    batch = attention(every, batch_keys, batch_values, every)
    for row in (0, 13, 23):
        only = torch.tensor([row])
        alone = attention(only, own_keys[only].clone(), own_values[only].clone(),
                          torch.tensor([0]))
        assert torch.equal(alone[0], batch[row])
        keys, values = own_keys.clone(), own_values.clone()
        assert torch.equal(attention(only, keys, values, only)[0], batch[row])
        assert torch.equal(keys[row], batch_keys[row]) and torch.equal(values[row],
                                                                       batch_values[row])
        others = every != row
        assert torch.equal(keys[others], own_keys[others])  # no other slot written
    hidden, weight = rand(rows, 64), rand(64)
    assert torch.equal(kernels.rms_norm(hidden[13:14], weight, 1e-5)[0],
                       kernels.rms_norm(hidden, weight, 1e-5)[13])
    gate_up = rand(rows, 96)
    assert torch.equal(kernels.silu_mul(gate_up[13:14])[0], kernels.silu_mul(gate_up)[13])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_native_step_in_bfloat16_stays_within_rounding_of_the_torch_step(kernels, kind):
    """bfloat16: the same dtype roundings as the torch operations, sums in another order; on
    the tiny model the logits stay within a few bfloat16 steps of the torch lean step's."""
    model = tiny(kind).to(torch.bfloat16)
    decoder = lean_decoder(model)
    torch_step, native_step = LeanStepper(decoder), LeanStepper(decoder, kernels)
    prompts = PROMPT_SETS[1]
    torch_step.prefill(prompts, 0, 2, 5)  # the prefill is the same code on both
    native_step.prefill(prompts, 0, 2, 5)
    tokens = torch.arange(len(prompts) * 2)
    for _ in range(5):
        expected, got = torch_step.step(tokens), native_step.step(tokens)
        torch.testing.assert_close(got.float(), expected.float(), atol=0.02, rtol=0.02)
        tokens = expected.argmax(-1)


def test_native_and_torch_decoding_sample_the_same_completions(kernels, tiny_config, tmp_path):
    """float32 end to end on the tiny model with the real tokenizer: generate_completions
    through either step samples the same tokens."""
    policy = load_policy(tiny_config(tmp_path), seed=0)
    prompts = [list(policy.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"]) for question in ("What is 3 + 4?", "Name a prime.")]
    settings = SamplingSettings(max_new_tokens=10, temperature=1.0, top_p=1.0, batch_size=8)
    with sampling_weights(policy):
        decoder = lean_decoder(policy.model)
        sampled = [generate_completions(policy.model, policy.tokenizer, prompts, 4, settings,
                                        seed=3, stepper=LeanStepper(decoder, chosen))
                   for chosen in (kernels, None)]
    native_ids, torch_ids = ([c.completion_token_ids for c in run] for run in sampled)
    assert native_ids == torch_ids and len(native_ids) == 8 and all(native_ids)


def test_the_torch_path_runs_where_the_kernels_do_not(monkeypatch, tmp_path):
    model = tiny("llama")
    assert CpuEngine(native=False).stepper(model).name == "lean"
    monkeypatch.setenv("GRPOGATE_NATIVE", "0")
    assert native.native_kernels(torch.float32, torch.device("cpu")) is None
    assert engine_for(model).stepper(model).name == "lean"
    monkeypatch.delenv("GRPOGATE_NATIVE")
    assert native.native_kernels(torch.float16, torch.device("cpu")) is None  # no fp16 build
    # No compiler: nothing is built and the torch path runs.
    native._load.cache_clear()
    monkeypatch.setenv("GRPOGATE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    try:
        assert native.native_kernels(torch.float32, torch.device("cpu")) is None
        assert engine_for(model).stepper(model).name == "lean"
        assert not (tmp_path / "native").exists() or not list((tmp_path / "native").iterdir())
    finally:
        native._load.cache_clear()


def test_shapes_the_attention_kernel_is_not_built_for_take_the_torch_step(kernels):
    # SmolLM2-135M: 9 heads over 3, d 64; Qwen2.5-0.5B: 14 over 2, d 64.
    assert kernels.covers(9, 3, 64) and kernels.covers(14, 2, 64)
    assert not kernels.covers(18, 2, 64)  # 9 query heads per KV head
    assert not kernels.covers(8, 2, 24)  # a head dimension off the kernel's 16 lanes
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=96,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2)).eval()  # d = 24
    assert engine_for(model).stepper(model).name == "lean"


def test_the_library_is_built_once_per_machine_hashed_and_a_truncated_one_rebuilt(
        monkeypatch, tmp_path):
    """Built once into an owner-only native/ with an owner-only sha256 record beside it; the
    second call finds it verified. Truncated, it is caught by the hash before the dynamic
    loader maps it (no SIGBUS), said on the terminal, rebuilt and loaded."""
    compiles = []
    real_run = native_build.subprocess.run

    def counting_run(command, **options):
        if "-o" in command:
            compiles.append(command)
        return real_run(command, **options)

    monkeypatch.setattr(native_build.subprocess, "run", counting_run)
    fd, first, problem = native_build.build_library(tmp_path)
    if fd is None:
        pytest.skip(f"no C++ compiler with OpenMP on this machine ({problem})")
    os.close(fd)
    assert first.parent == tmp_path / "native" and first.is_file()
    assert stat.S_IMODE(first.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(first.with_suffix(".sha256").stat().st_mode) == 0o600
    fd, again, _ = native_build.build_library(tmp_path)
    os.close(fd)
    assert again == first and len(compiles) == 1  # the second call finds it built
    assert sorted(p.name for p in first.parent.iterdir()) == sorted(
        [".build.lock", first.name, first.with_suffix(".sha256").name])  # no temporary left

    with open(first, "r+b") as handle:
        handle.truncate(first.stat().st_size // 3)
    done = _load_in_child(tmp_path)
    assert done.returncode == 0, done.stderr  # -7 would be SIGBUS
    assert "does not match the sha256 in its record" in done.stderr
    assert "rebuilding it" in done.stderr
    status = json.loads(done.stdout.splitlines()[-1])
    assert status == {"built": True, "identity": first.stem, "reason": native.VERIFIED}


# --- only what grpogate built loads --------------------------------------------------------------

PLANTED_C = """#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("planted code ran\\n", f); fclose(f); }
}
"""
MEMORY_CAP = 4 << 30
CHILD = """
import json, torch
from grpogate.files import cache_dir
from grpogate.engines.cpu import native, native_build
kernels = native.native_kernels(torch.float32, torch.device("cpu"))
status = native.kernels_identity(torch.float32, torch.device("cpu"))
assert (kernels is None) == (not status["built"])
print(json.dumps(status))
"""


def _load_in_child(root: Path, **env: str) -> subprocess.CompletedProcess:
    """Load the kernels from cache `root` in a fresh process under a memory cap and a timeout:
    a hostile library kills the child, never the test run."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    environment = {**os.environ, "GRPOGATE_CACHE": str(root), "PYTHONPATH": SRC, **env}
    environment.pop("GRPOGATE_NATIVE", None)
    return subprocess.run([sys.executable, "-c", CHILD], env=environment, capture_output=True,
                          text=True, timeout=300, preexec_fn=cap)


def _plant(target: Path, marker: Path) -> None:
    """A shared library whose constructor writes `marker`, at the kernels' key path."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the planted library")
    source = target.parent.parent / "planted.c"
    target.parent.mkdir(parents=True, exist_ok=True)
    source.write_text(PLANTED_C)
    subprocess.run([compiler, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(target),
                    str(source)], check=True, capture_output=True)
    source.unlink()


@pytest.fixture
def failing_compiler(tmp_path, monkeypatch) -> Path:
    """A C++ "compiler" that answers --version and fails every build (error: no build here):
    a cache's library then loads only if it verifies, and no build takes 20 s."""
    script = tmp_path / "fake-c++"
    script.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "fake c++ 1.0"; exit 0; fi\n'
                      'echo "error: no build here" >&2; exit 1\n')
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    return script


@pytest.mark.parametrize("shared", ["cache world-writable", "native/ world-writable",
                                    "native/ of another user", "under a non-sticky shared dir"])
def test_a_library_planted_in_a_cache_others_can_write_never_runs(shared, tmp_path,
                                                                   failing_compiler):
    root = tmp_path / "parent" / "cache"
    target = native_build.library_path(root)
    marker = tmp_path / "marker"
    _plant(target, marker)
    if shared == "cache world-writable":
        root.chmod(0o777)
    elif shared == "native/ world-writable":
        target.parent.chmod(0o777)
    elif shared == "native/ of another user":
        if os.getuid() != 0:
            pytest.skip("only root can give a directory to another user")
        os.chown(target.parent, 65534, 65534)
    else:
        (tmp_path / "parent").chmod(0o777)
    done = _load_in_child(root, CXX=str(failing_compiler))
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    status = json.loads(done.stdout.splitlines()[-1])
    assert status["built"] is False and status["identity"] == "none"
    assert status["reason"].startswith("the cache directory ")
    said = [line for line in done.stderr.splitlines() if "native kernels not used" in line]
    assert len(said) == 1 and "the torch operations run instead" in said[0]
    assert target.read_bytes()  # refused, not touched


@pytest.mark.parametrize("record", ["no record", "a forged record", "another user's record"])
def test_a_library_planted_in_an_owner_only_cache_never_runs(record, tmp_path, monkeypatch,
                                                             failing_compiler):
    """In the user's own cache, a library without a record this user's grpogate wrote is
    rebuilt (here the build fails: the torch path, said once), never loaded."""
    root = tmp_path / "cache"
    target = native_build.library_path(root)
    marker = tmp_path / "marker"
    _plant(target, marker)
    os.chmod(root, 0o700), os.chmod(target.parent, 0o700)
    fields = {"library": target.name,
              "sha256": hashlib.sha256(target.read_bytes()).hexdigest()}
    if record == "a forged record":
        target.with_suffix(".sha256").write_text(json.dumps({"fields": fields, "hmac": "0" * 64}))
        target.with_suffix(".sha256").chmod(0o600)
    elif record == "another user's record":  # written under another key, then copied here
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "other-user"))
        cache_dir.record_key.cache_clear()
        try:
            cache_dir.write_record(target.with_suffix(".sha256"), fields)
        finally:
            cache_dir.record_key.cache_clear()
        monkeypatch.delenv("XDG_CONFIG_HOME")
    done = _load_in_child(root, CXX=str(failing_compiler))
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    assert "is not loaded: its record" in done.stderr and "rebuilding it" in done.stderr
    status = json.loads(done.stdout.splitlines()[-1])
    assert status["built"] is False and "error: no build here" in status["reason"]
    assert done.stderr.count("native kernels not used") == 1


def test_the_kernels_build_in_the_configured_cache_dir(tiny_config, tmp_path):
    """A run's `cache_dir` is where the kernels build, not only $GRPOGATE_CACHE's place."""
    config = tiny_config(tmp_path, cache_dir=str(tmp_path / "configured"))
    try:
        load_policy(config)
        assert cache_dir.configured_cache_root() == tmp_path / "configured"
    finally:
        cache_dir.use_cache_dir("")


def test_the_evidence_says_why_the_kernels_did_not_run(monkeypatch):
    monkeypatch.setenv("GRPOGATE_NATIVE", "0")
    assert native.kernels_identity(torch.float32, torch.device("cpu")) == {
        "built": False, "reason": "GRPOGATE_NATIVE=0", "identity": "none"}
    monkeypatch.delenv("GRPOGATE_NATIVE")
    assert native.kernels_identity(torch.float16, torch.device("cpu"))["reason"] == (
        "float16: the kernels are for bfloat16 and float32")


def test_the_cpu_identity_names_the_processor():
    identity = native_build.cpu_identity()
    assert platform.machine() in identity
    if Path("/proc/cpuinfo").is_file():
        assert "model" in identity or "CPU part" in identity


def test_row_logsumexp_and_its_backward_by_hand(kernels):
    # One row z = [0, ln 3], T = 1: lse = ln(1 + 3) = 1.3862944, p = [1/4, 3/4], entropy
    # -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351. At T = 2: z / T = [0, ln 3 / 2], lse =
    # ln(1 + sqrt 3) = 1.0050525.
    logits = torch.tensor([[0.0, math.log(3)]])
    lse, entropy = kernels.row_logsumexp(logits, 1.0, True)
    torch.testing.assert_close(lse, torch.tensor([1.3862944]))
    torch.testing.assert_close(entropy, torch.tensor([0.5623351]))
    assert kernels.row_logsumexp(logits, 2.0, False)[1] is None
    torch.testing.assert_close(kernels.row_logsumexp(logits, 2.0, False)[0],
                               torch.tensor([1.0050525]))
    # Tokens 1 and 0 both predicted at row 0 with d loss / d value 2 and -1, T = 1: the
    # gradient is onehot(1) * 2 + onehot(0) * (-1) - p * (2 - 1) = [-1 - 1/4, 2 - 3/4]
    # = [-1.25, 1.25]; a row no token uses (row 1) gets zeros.
    two = torch.tensor([[0.0, math.log(3)], [5.0, -5.0]])
    lse, _ = kernels.row_logsumexp(two, 1.0, False)
    grad = kernels.logprob_backward(two, lse, 1.0, torch.tensor([0, 2, 2]),
                                    torch.tensor([0, 1]), torch.tensor([1, 0]),
                                    torch.tensor([2.0, -1.0]))
    torch.testing.assert_close(grad, torch.tensor([[-1.25, 1.25], [0.0, 0.0]]))


def test_row_kl_by_hand(kernels):
    # p = softmax([0, ln 3]) = [1/4, 3/4], q = softmax([0, 0]) = [1/2, 1/2]:
    # KL(p || q) = 1/4 ln(1/2) + 3/4 ln(3/2) = -0.1732868 + 0.3040988 = 0.1308120, and p's
    # entropy 0.5623351 (above). At T = 2 own / T = [0, ln 3 / 2]: p = [1, sqrt 3] / (1 + sqrt
    # 3) = [0.3660254, 0.6339746], KL = 0.3660254 ln(0.7320508) + 0.6339746 ln(1.2679492)
    # = 0.3660254 (-0.3119054) + 0.6339746 (0.2374008) = -0.1141653 + 0.1505061 = 0.0363408.
    # Row 1: p = q, so KL 0 and entropy ln 2.
    own = torch.tensor([[0.0, math.log(3)], [1.0, 1.0]])
    base = torch.tensor([[0.0, 0.0], [-4.0, -4.0]])
    kl, entropy = kernels.row_kl(own, base, 1.0)
    torch.testing.assert_close(kl, torch.tensor([0.1308120, 0.0]))
    torch.testing.assert_close(entropy, torch.tensor([0.5623351, math.log(2)]))
    torch.testing.assert_close(kernels.row_kl(own[:1], base[:1], 2.0)[0],
                               torch.tensor([0.0363408]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kl_matches_the_torch_formula(kernels, dtype):
    """A vocabulary not a multiple of 16 lanes, logits spread like a model's (|z / T| up to
    about 20): within float32 rounding of the float64 values of the same logits."""
    generator = torch.Generator().manual_seed(5)
    own = (torch.randn(23, 1003, generator=generator) * 4).to(dtype)
    base = (own.float() + torch.randn(23, 1003, generator=generator)).to(dtype)
    kl, entropy = kernels.row_kl(own, base, 0.7)
    mine = torch.log_softmax(own.double() / 0.7, -1)
    reference = torch.log_softmax(base.double() / 0.7, -1)
    torch.testing.assert_close(kl.double(), (mine.exp() * (mine - reference)).sum(-1),
                               atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), -(mine.exp() * mine).sum(-1), atol=2e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_log_prob_head_matches_torch(kernels, dtype, monkeypatch):
    """picked_logprobs on the kernels against the torch head, a vocabulary not a multiple of
    the kernels' 16 lanes and positions predicting several tokens: float32 within 1e-5 (the
    entropy within float32 rounding of the float64 value, below); in
    bfloat16 the values are float32 from the same logits (1e-5), and the gradient rounds each
    element once (the torch head also rounds it once), so within one bfloat16 step of it."""
    from grpogate.training.logprobs import picked_logprobs
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(37, 1003, generator=generator) * 3).to(dtype)
    index = torch.randint(0, 37, (90,), generator=generator)
    tokens = torch.randint(0, 1003, (90,), generator=generator)
    weights = torch.randn(90, generator=generator)

    def run():
        x = logits.clone().requires_grad_(True)
        entropy = []
        values = picked_logprobs(x, index, tokens, 0.7, 16, entropy)
        (grad,) = torch.autograd.grad((values * weights).sum(), x)
        return values, entropy[0], grad.float()

    native_values, native_entropy, native_grad = run()
    monkeypatch.setenv("GRPOGATE_NATIVE", "0")
    torch_values, torch_entropy, torch_grad = run()
    torch.testing.assert_close(native_values, torch_values, atol=1e-5, rtol=0)
    # The entropy is lse - sum(p z) with z = logits / T: here |z| reaches 14 while the
    # entropy is 0.4-3, so both heads lose float32 ulps of the terms, not of the result, and
    # their sums' orders differ (the kernel's lanes follow the CPU's vector width). Each must
    # be within 16 float32 ulps of those terms (2^-24 x 16 x (|lse| + sum p|z|) = 1e-6 x 28
    # at most here) of the float64 entropy of the same logits; a wrong formula is off by 1e-2.
    z = logits.double()[index] / 0.7
    p = z.softmax(-1)
    lse = torch.logsumexp(z, -1)
    exact = lse - (p * z).sum(-1)
    ulps = 16 * 2 ** -24 * (lse.abs() + (p * z.abs()).sum(-1))
    for entropy in (native_entropy, torch_entropy):
        assert ((entropy.double() - exact).abs() <= ulps).all()
    step = 1e-5 if dtype == torch.float32 else 2 ** -7 * torch_grad.abs().clamp(min=2 ** -120)
    assert ((native_grad - torch_grad).abs() <= step).all()


def test_sample_rows_by_hand(kernels):
    # T = 1, logits [0, ln 3, ln 2, ln 2], blocks of 2: e = exp(z - ln 3) = [1/3, 1, 2/3, 2/3],
    # block masses [4/3, 4/3], cumulative [4/3, 8/3].
    # u = 0.1: draw 0.2667 < 4/3 -> block 0; inside [1/3, 4/3] > 0.2667 first at 0 -> token 0,
    #   log p = (0 - ln 3) - ln(8/3) = ln(1/8).
    # u = 0.6: draw 1.6 -> block 1, rest 1.6 - 4/3 = 0.2667 < 2/3 -> token 2, log p = ln(1/4).
    # u = 0.99: draw 2.64 -> block 1, rest 1.3067 > 2/3 -> token 3, log p = ln(1/4).
    z = torch.tensor([0.0, math.log(3), math.log(2), math.log(2)])
    logits = z.repeat(3, 1)
    tokens, logprobs = kernels.sample_rows(logits, 1.0, 2, torch.tensor([0.1, 0.6, 0.99],
                                                                         dtype=torch.float64))
    assert tokens.tolist() == [0, 2, 3]
    torch.testing.assert_close(logprobs, torch.tensor([math.log(1 / 8), math.log(1 / 4),
                                                       math.log(1 / 4)]), atol=1e-6, rtol=0)
    # A vocabulary that is not a whole number of blocks (5 entries, blocks of 2): the last
    # token is reachable, and a draw rounded past the end falls on the last token with mass.
    z5 = torch.tensor([[0.0, 0.0, -1e30, 0.0, 0.0]])
    assert kernels.sample_rows(z5, 1.0, 2, torch.tensor([0.99], dtype=torch.float64))[0] == 4
    z5 = torch.tensor([[0.0, 0.0, 0.0, 0.0, -1e30]])
    assert kernels.sample_rows(z5, 1.0, 2, torch.tensor([1.0], dtype=torch.float64))[0] == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_sampler_draws_what_the_torch_sampler_draws(kernels, dtype, monkeypatch):
    """rollout._sample, whole distribution: the same tokens from the same uniforms, log-probs
    within float32 rounding, for 2,000 rows of SmolLM2's vocabulary at the run's temperature."""
    from grpogate.sampling import rollout

    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(2000, 49152, generator=generator) * 4).to(dtype)
    uniforms = torch.rand((2000, 1), generator=generator, dtype=torch.float64)
    native_tokens, native_logp = rollout._sample(logits, 0.7, 1.0, uniforms, with_logprobs=True)
    monkeypatch.setattr(rollout, "row_kernels", lambda dtype, device: None)
    torch_tokens, torch_logp = rollout._sample(logits, 0.7, 1.0, uniforms, with_logprobs=True)
    # The block masses differ by summation order (a few float32 ulps), so a draw within that
    # of a boundary could land on the neighbouring token: none did here.
    assert torch.equal(native_tokens, torch_tokens)
    # log p of magnitude up to ~40: float32 rounding of the max, the division and log(total)
    torch.testing.assert_close(native_logp, torch_logp, atol=2e-5, rtol=1e-6)
    # A torch.Generator draws the same uniforms as the tensor above, before the logits' work.
    again = torch.Generator().manual_seed(0)
    torch.randn(2000, 49152, generator=again)
    monkeypatch.undo()
    assert torch.equal(rollout._sample(logits, 0.7, 1.0, again), native_tokens)
