"""The lean decode forward against the model's own forward: same logits, same samples, and the
cases where it must step aside (other architectures, active unmerged LoRA, hooks)."""

from __future__ import annotations

import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from grpogate.engines.cpu.decoding import LeanStepper
from grpogate.engines.reference import ModelStepper
from grpogate.engines.rows import shared_prefix_length
from grpogate.engines.cpu.layers import tiled_linear
from grpogate.engines.cpu import scoring
from grpogate.engines.cpu.scoring import LeanScorer, packed_row, segment_mask
from grpogate.engines.cpu.weights import can_prepack, lean_decoder, linear, prepack
from grpogate.inputs.policy import load_policy, sampling_weights

SIZES = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def tiny(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SIZES)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**SIZES)).eval()  # q/k/v carry biases


# No common prefix; then a 20-token common prefix (rounded down to 16) with ragged suffixes.
PROMPT_SETS = [
    [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11]],
    [list(range(1, 21)) + [30, 31], list(range(1, 21)) + [40], list(range(1, 21)) + [50] * 19],
]


needs_prepack = pytest.mark.skipif(not can_prepack(torch.zeros(1, dtype=torch.bfloat16)),
                                   reason="no oneDNN bfloat16 kernels on this CPU")


@needs_prepack
def test_a_prepacked_weight_gives_the_same_bits_as_f_linear():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=generator).bfloat16()
    bias = torch.randn(48, generator=generator).bfloat16()
    packed = prepack(weight)
    assert packed.is_mkldnn and not weight.is_mkldnn  # a copy; the model's tensor is untouched
    wide = torch.randn(3, 5, 80, generator=generator).bfloat16()
    for x in (torch.randn(7, 40, generator=generator).bfloat16(),  # decode rows
              torch.randn(2, 9, 40, generator=generator).bfloat16(),  # prefill [n, T, D]
              wide[..., ::2]):  # a strided view
        for b in (None, bias):
            # On a strided 3-D input F.linear adds the bias after rounding the product (one
            # rounding more); on the same values laid out contiguously it rounds once, as oneDNN.
            expected = torch.nn.functional.linear(x.contiguous(), weight, b)
            assert torch.equal(linear(x, packed, b), expected)
            assert torch.equal(linear(x.contiguous(), weight, b), expected)  # unpacked: F.linear


@needs_prepack
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_prepacked_lean_decoder_gives_the_same_logits_bits_as_plain_weights(kind):
    model = tiny(kind).to(torch.bfloat16)
    packed, plain = lean_decoder(model, pack=True), lean_decoder(model, pack=False)
    assert packed.lm_head.is_mkldnn and all(layer.qkv.is_mkldnn for layer in packed.layers)
    assert not plain.lm_head.is_mkldnn
    a, b = LeanStepper(packed), LeanStepper(plain)
    prompts = PROMPT_SETS[1]
    assert torch.equal(a.prefill(prompts, 0, 2, 4), b.prefill(prompts, 0, 2, 4))
    tokens = torch.arange(len(prompts) * 2)
    for _ in range(3):
        logits = a.step(tokens)
        assert torch.equal(logits, b.step(tokens))
        tokens = logits.argmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_scored_logits_do_not_depend_on_the_prompts_beside_it(dtype, monkeypatch):
    """Packed rows of one width share a forward: a prompt's logits are the same bits alone,
    beside prompts of its width, and with the attention budget forcing one prompt per forward;
    the segment mask keeps each completion to the prompt and itself."""
    model = tiny("llama").to(dtype)
    decoder = lean_decoder(model)
    groups = [([30 + g, 31], [[7, 8, 9 + g], [4, g], [5]]) for g in range(5)]
    together = LeanScorer(decoder, list(range(1, 17))).score(groups, pad_id=0)
    alone = LeanScorer(decoder, list(range(1, 17))).score(groups[3:4], pad_id=0)
    assert all(torch.equal(a, b) for a, b in zip(together[3], alone[0]))
    monkeypatch.setattr(scoring, "ATTENTION_BUDGET", 1)
    one_each = LeanScorer(decoder, list(range(1, 17))).score(groups, pad_id=0)
    assert all(torch.equal(a, b) for x, y in zip(together, one_each) for a, b in zip(x, y))


def test_segment_mask_lets_a_completion_see_the_prompt_and_itself():
    """Row: prompt (2 tokens), completion 1 (2), completion 2 (1), one pad."""
    allowed = segment_mask(torch.tensor([[0, 0, 1, 1, 2, -1]]))[0] == 0
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0],
                             [1, 1, 1, 1, 0, 0],
                             [1, 1, 0, 0, 1, 0],   # completion 2 skips completion 1
                             [0, 0, 0, 0, 0, 1]],  # the pad attends to itself alone
                            dtype=torch.bool)
    assert torch.equal(allowed, expected)
    assert packed_row([30, 31], [[7, 8, 9], [4], []]) == ([30, 31, 7, 8], [(2, 2), (4, 0),
                                                                           (4, 0)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_linear_gives_a_row_the_same_bits_in_any_batch(dtype):
    """Products of a fixed row count: a row's result depends neither on the batch's size nor
    on its place or neighbours (on the CPU's bfloat16 kernels a plain product's rows differ
    between 16 and 48 rows)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator).to(dtype)
    if can_prepack(weight):
        weight = prepack(weight)
    rows = torch.randn(300, 64, generator=generator).to(dtype)
    alone = tiled_linear(rows[:5], weight, None, tile=32)
    for batch in (rows[:40], rows[:300], torch.cat([rows[200:210], rows[:5]])):
        got = tiled_linear(batch, weight, None, tile=32)
        where = slice(10, 15) if len(batch) == 15 else slice(0, 5)
        assert torch.equal(got[where], alone)
    expected = torch.nn.functional.linear(rows[:40].float(), (weight.to_dense() if weight.is_mkldnn
                                                             else weight).float())
    torch.testing.assert_close(tiled_linear(rows[:40], weight, None, tile=32).float(), expected,
                               atol=0.05 if dtype == torch.bfloat16 else 1e-5, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_prefill_does_not_depend_on_the_prompts_beside_it(dtype):
    """Prompts of one padded width are prefilled together (`forward_rows`): a prompt's first
    logits are the same bits alone, second in a batch, and beside prompts of another width or
    more prompts than one forward takes (its place in the batch and the batch's size vary)."""
    model = tiny("llama").to(dtype)
    decoder = lean_decoder(model)
    prefix = list(range(1, 17))
    mine = prefix + [30, 31, 32]
    others = [prefix + [40 + i, 7] for i in range(20)] + [prefix + [50] * 19]

    def first_logits(prompts, row):
        logits = LeanStepper(decoder).prefill(prompts, 0, 2, 4, shared=16)
        return logits[2 * row]

    alone = first_logits([mine], 0)
    for prompts, row in (([others[0], mine], 1), ([others[-1], mine, others[1]], 1),
                         (others[:18] + [mine], 18)):
        assert torch.equal(first_logits(prompts, row), alone)


def test_float32_weights_are_prepacked_exactly_where_can_prepack_says():
    decoder = lean_decoder(tiny("llama"), pack=True)
    expected = can_prepack(torch.zeros(1))
    assert decoder.lm_head.is_mkldnn == expected
    assert all(layer.qkv.is_mkldnn == expected and layer.down.is_mkldnn == expected
               for layer in decoder.layers)
    assert not lean_decoder(tiny("llama"), pack=False).lm_head.is_mkldnn


@pytest.mark.skipif(not can_prepack(torch.zeros(1)), reason="float32 weights are not prepacked here")
def test_a_prepacked_float32_weight_rounds_within_float32_of_f_linear():
    """oneDNN's float32 kernel is not MKL's: the sums' order differs, so results agree to
    float32 rounding (a few ulps of the result), not to the bit."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=generator)
    bias = torch.randn(48, generator=generator)
    packed = prepack(weight)
    assert packed.is_mkldnn and not weight.is_mkldnn
    for x in (torch.randn(7, 40, generator=generator), torch.randn(2, 9, 40, generator=generator)):
        expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
        got = linear(x, packed, bias)
        assert got.dtype == torch.float32 and got.shape == expected.shape
        # |sum of 40 products| <= 40 x |x| |w|: float32's 2^-24 relative rounding per addition
        # bounds the error by about 40 x 2^-24 x sum|x w|; 1e-5 relative to it is safe.
        scale = (x.double().abs() @ weight.double().abs().T) + bias.double().abs()
        assert ((got.double() - expected).abs() <= 1e-5 * scale).all()


def test_shared_prefix_leaves_every_prompt_a_token():
    assert shared_prefix_length([[1, 2, 3]] * 3) == 2  # the last token stays each prompt's own
    assert shared_prefix_length([list(range(40)), list(range(40))]) == 39
    assert shared_prefix_length([list(range(20)) + [7], list(range(20)) + [8]]) == 20
    assert shared_prefix_length([list(range(17)), [0] + list(range(30))]) == 1
    assert shared_prefix_length([list(range(16)), list(range(40))]) == 15


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("shared", [5, 16, 19])
def test_prefill_with_a_shared_prefix_of_any_length(shared, native):
    """The prefix computed once at any length (its 16-column block left-padded and masked, the
    prompts' own parts after it) gives the logits of no shared prefix, and so does the first
    decode step after it (float32: the same sums in other tiles, within 1e-5)."""
    from grpogate.engines.cpu.native import native_kernels

    model = tiny("llama")
    decoder = lean_decoder(model)
    kernels = native_kernels(torch.float32, torch.device("cpu")) if native else None
    if native and (kernels is None or not kernels.covers(decoder.heads, decoder.kv_heads,
                                                         decoder.head_dim)):
        pytest.skip("no native kernels for this model here")
    prompts = [list(range(1, 20)) + [30, 31, 32], list(range(1, 20)) + [40, 7],
               list(range(1, 20)) + [50] * 9]
    plain, stepper = LeanStepper(decoder, kernels), LeanStepper(decoder, kernels)
    expected = plain.prefill(prompts, 0, 2, 4, shared=0)
    got = stepper.prefill(prompts, 0, 2, 4, shared=shared)
    assert stepper.prompt_mask.shape[1] % 16 == 0  # the span the native step reads
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    tokens = torch.tensor([3, 4, 5, 6, 7, 8])
    torch.testing.assert_close(stepper.step(tokens), plain.step(tokens), atol=1e-5, rtol=1e-5)


def test_trained_lora_is_sampled_through_merged_weights_not_skipped(tiny_config, tmp_path):
    policy = load_policy(tiny_config(tmp_path), seed=0)
    with torch.no_grad():  # a trained adapter: B != 0, so the LoRA delta changes the logits
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    assert lean_decoder(policy.model) is None  # active, unmerged LoRA: the lean path steps aside
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    expected = ModelStepper(policy.model).prefill(prompts, 0, 1, 2)  # adapter on, unmerged
    with sampling_weights(policy):
        got = LeanStepper(lean_decoder(policy.model)).prefill(prompts, 0, 1, 2)
    with sampling_weights(policy, baseline=True):
        baseline = LeanStepper(lean_decoder(policy.model)).prefill(prompts, 0, 1, 2)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (got - baseline).abs().max() > 1e-2  # the delta mattered, and lean applied it


def test_other_architectures_and_hooked_models_use_the_model_forward():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=2))
    assert lean_decoder(gpt2) is None
    sliding = Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert lean_decoder(Qwen2ForCausalLM(sliding)) is None
    model = tiny("llama")
    handle = model.lm_head.register_forward_hook(lambda module, inputs, output: output + 1)
    assert lean_decoder(model) is None
    handle.remove()
    assert lean_decoder(model) is not None
