"""The CPU accelerator's decode forward: the lean decoder of the supported models (capability.py).

`LeanStepper` is a "stepper" (the `Stepper` interface, engines/__init__.py): prefill(prompts)
-> logits, step(tokens) -> logits, select(rows) when finished rows leave the batch. The
reference engine's `ModelStepper` (engines/reference.py) calls the model's forward with a
transformers cache and works for any architecture, but at decode time that forward does much
of its work around the matrix products (per-layer dtype copies, a KV cache grown by torch.cat
each step, SDPA on a one-token query; docs/measurements.md, "Figures moved from code
comments"), so `LeanStepper` runs the same mathematics for the supported decoder directly on
the model's weight tensors, as they are at the moment of the call:

- q/k/v and gate/up are fused into one matrix product each (5 products per layer become 2),
- the KV cache is allocated once for the whole rollout and written in place, each prompt's
  part once (not once per sampled row) and each row's generated part,
- grouped-query attention is batched matmuls (K/V never repeated per head, a prompt's keys
  read once per step for all its G rows),
- the prompts' common prefix (system prompt, chat template) is prefilled once, at batch 1,
  and the prompts' own tokens in batches whose products have one row count (`forward_rows`),
- cos/sin tables come from the model's own rotary module, once per rollout,
- on a CPU with oneDNN bfloat16 kernels, every weight is reordered once per rollout into the
  kernel's blocked layout ("prepacked"), so a decode step no longer reorders the weights on
  every call (the results are bit-identical); in float32 on an x86 CPU too, where F.linear
  runs MKL's sgemm and oneDNN on prepacked weights is the faster kernel at these row counts
  but rounds its sums in another order (weights.can_prepack; docs/measurements.md, "Figures
  moved from code comments").

`lean_decoder(model)` (weights.py, which holds the fused and prepacked weights) returns None
for anything it does not cover (a model `capability.describe` declines, LoRA layers that are
active and unmerged, forward hooks), and the engine then steps with `ModelStepper`. The
blocks' mathematics, shared with the re-test's scorer, is in layers.py. Tests compare both
paths' logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grpogate.engines.cpu.layers import (MASKED, chunks_by_shape, decoder_layers, decoder_logits,
                                        forward_rows, prefix_forward, tiled_linear)
from grpogate.engines.cpu.native import NativeKernels
from grpogate.engines.cpu.weights import LeanDecoder, linear
from grpogate.engines.rows import WIDTH_BUCKET, round_up, shared_prefix_length


class LeanStepper:
    """Prefill a batch of prompts once, then decode one token per call for G rows per prompt.

    The cache holds each prompt's part once, not once per row: keys transposed [n, Hkv, d, S]
    and values [n, Hkv, S, d] over the columns [shared prefix | the prompt's suffix,
    left-padded], S in all, with an additive mask [n, S] for the padding; and each row's own
    generated part, keys and values [N, Hkv, T, d] (keys [N, Hkv, d, T] for the native step).
    The prefix the prompts have in common (system prompt and chat template, typically) is
    computed once at batch 1, not once per prompt; the prompts' suffixes attend to it,
    forwarded together by `forward_rows` (`_prefill_suffixes`). A decode step attends a row to
    its prompt's part in one matrix product per prompt (its G rows' queries against keys read
    once, `_step_attention`; with the native kernels, `_native_step`) and to its own columns,
    one softmax over both. A cache repeated G times would read the prompt's keys once per row,
    and a prompt can be most of a row's columns; held once per prompt, they are read once per
    step for all G rows (docs/measurements.md, "Figures moved from code comments").
    Row r of the prefill's batch is slot r = prompt x G + sample; `slots` maps the rows still
    in the batch to theirs, since finished rows leave it (`select`). The native step reads a
    row's own cache at its slot, so a row leaving moves no cache; the torch step's cache
    holds the rows still in the batch, compacted when rows leave.
    """

    holds_weights = True  # it reads its decoder's fused copies, not the model's tensors

    def __init__(self, decoder: LeanDecoder, kernels: NativeKernels | None = None):
        self.decoder, self.kernels = decoder, kernels
        # recorded in the evidence: the decode step's non-product work native or torch's
        self.name = "lean" if kernels is None else "lean-native"

    def fresh(self) -> "LeanStepper":
        """A new stepper on the same weights (a second decode in lockstep with this one)."""
        return LeanStepper(self.decoder, self.kernels)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], pad_id: int, group_size: int,
                max_new_tokens: int, shared: int | None = None) -> torch.Tensor:
        """n prompts' token lists -> next-token logits [n G, V], prompt-major.

        `shared`: the prefix length to compute once, fixed by the caller over the whole prompt
        set (`shared_prefix_length` of all train or eval prompts) so that a prompt's numerics
        do not depend on which prompts share its batch or rank; default: this batch's."""
        dec = self.decoder
        dtype, device = dec.embed.dtype, dec.embed.device
        shared = shared_prefix_length(prompts) if shared is None else min(
            shared, shared_prefix_length(prompts))
        # The prefix's columns: its forward left-pads it to a WIDTH_BUCKET multiple (the pads
        # masked), so that the span stays a multiple of 16, as the native step reads it.
        head = round_up(shared, WIDTH_BUCKET)
        suffixes = [p[shared:] for p in prompts]
        width = round_up(max(len(x) for x in suffixes), WIDTH_BUCKET)
        span = head + width
        columns = torch.arange(span + max_new_tokens, device=device)[None]
        cos, sin = dec.rotary(dec.embed[:1], columns)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [C, d]
        # Zeros, not empty: masked columns get probability 0, and 0 x NaN would still be NaN.
        # The native step's own caches start zeroed too, so that a decode's tokens never depend
        # on what memory the allocator hands over (docs/measurements.md, "A first decode that
        # rounds differently").
        rows = len(prompts) * group_size
        # The native step keeps the rows' own keys transposed too, [N, Hkv, d, T], T a
        # multiple of 16 (its score loop reads 16 columns at a time), like the prompts' keys.
        own = round_up(max_new_tokens, 16)
        self.prompt_keys, self.prompt_values = (
            [torch.zeros(shape, dtype=dtype, device=device) for _ in dec.layers] for shape in (
                (len(prompts), dec.kv_heads, dec.head_dim, span),
                (len(prompts), dec.kv_heads, span, dec.head_dim)))
        self.keys, self.values = (
            [torch.zeros(shape, dtype=dtype, device=device) for _ in dec.layers] for shape in (
                (rows, dec.kv_heads, dec.head_dim, own) if self.kernels else
                (rows, dec.kv_heads, max_new_tokens, dec.head_dim),
                (rows, dec.kv_heads, own if self.kernels else max_new_tokens, dec.head_dim)))

        prefix = None
        self.prompt_mask = torch.full((len(prompts), span), MASKED, device=device)
        if shared:  # keys [1, Hkv, d, head], values [1, Hkv, head, d], mask [1, head]
            prefix = prefix_forward(dec, prompts[0][:shared])
            for index in range(len(dec.layers)):
                self.prompt_keys[index][..., :head] = prefix[0][index]
                self.prompt_values[index][:, :, :head] = prefix[1][index]
            self.prompt_mask[:, :head] = prefix[2]
        suffix_mask, last_logits = self._prefill_suffixes(suffixes, pad_id, shared, head, width,
                                                          prefix)
        self.prompt_mask[:, head:] = torch.where(suffix_mask.bool(), 0.0, MASKED)
        positions = shared + (suffix_mask.cumsum(-1) - 1).clamp(min=0)  # [n, W]
        self.positions = positions[:, -1].repeat_interleave(group_size, dim=0)  # [N]
        self.own_mask = torch.full((max_new_tokens,), MASKED, device=device)
        self.group, self.generated = group_size, 0
        self.slots = torch.arange(len(prompts) * group_size, device=device)
        return last_logits.repeat_interleave(group_size, dim=0)

    def _prefill_suffixes(self, suffixes, pad_id, shared, head, width, prefix):
        """Each prompt's own tokens (from position `shared`) attending to the prefix (its
        `head` columns), its block flush right in the prompt's W columns: -> (real-token mask
        [n, W], next-token logits [n, V]).

        Prompts of one padded width go through `forward_rows` together, PROMPTS_PER_FORWARD at
        a time, so a prompt computes the same numbers whatever batch or rank it lands in
        (world-size invariance) without a forward of its own, which would read every weight
        once per prompt (docs/measurements.md, "Figures moved from code comments")."""
        dec = self.decoder
        suffix_mask = torch.zeros((len(suffixes), width), dtype=torch.long,
                                  device=dec.embed.device)
        last = [None] * len(suffixes)  # each prompt's last hidden state [D]
        for chunk in chunks_by_shape([round_up(len(s), WIDTH_BUCKET) for s in suffixes]):
            hidden, (keys, values, mask) = forward_rows(
                dec, [suffixes[i] for i in chunk], [shared] * len(chunk), prefix, keep=True,
                pad_id=pad_id)
            own = hidden.shape[1]
            columns = slice(head + width - own, head + width)
            for index in range(len(dec.layers)):
                self.prompt_keys[index][chunk, ..., columns] = keys[index][..., head:]
                self.prompt_values[index][chunk, :, columns] = values[index][:, :, head:]
            suffix_mask[chunk, width - own:] = (mask[:, head:] == 0).long()
            for i, row in zip(chunk, hidden[:, -1]):
                last[i] = row
        return suffix_mask, decoder_logits(dec, torch.stack(last), tiled_linear)

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [N] -> next-token logits [N, V]; their K/V go into the rows' next column."""
        if self.kernels is not None:
            return self._native_step(token_ids)
        column = self.generated
        self.positions = self.positions + 1
        cos, sin = self.cos[self.positions][:, None, None], self.sin[self.positions][:, None, None]

        def attend(index, k, v):  # k/v [N, 1, Hkv, d]
            self.keys[index][:, :, column] = k[:, 0]
            self.values[index][:, :, column] = v[:, 0]
            return ((self.prompt_keys[index], self.keys[index]),
                    (self.prompt_values[index], self.values[index]))

        # The rows' own part is read whole, its unwritten columns masked: a slice of it is a
        # strided operand that the bfloat16 product first copies, so a slice saves nothing over
        # a rollout (docs/measurements.md, "Figures moved from code comments"); whole, every
        # step's products keep one shape.
        self.own_mask[column] = 0.0
        prompt_mask = self.prompt_mask[self.slots // self.group]  # [N, S]
        mask = torch.cat([prompt_mask, self.own_mask.expand(len(prompt_mask), -1)], dim=1)
        hidden = decoder_layers(self.decoder, F.embedding(token_ids[:, None], self.decoder.embed),
                                cos, sin, mask, attend, attention=self._step_attention)
        self.generated = column + 1
        return decoder_logits(self.decoder, hidden[:, -1])

    def _native_step(self, token_ids: torch.Tensor) -> torch.Tensor:
        """`step` with everything but the matrix products in three native calls per layer
        (native_kernels.cpp: RMSNorm with the residual add before it, SiLU x up, and RoPE,
        cache write and both attention parts under one softmax), the same mathematics and
        dtype roundings as the torch operations of `step`."""
        dec, kernels = self.decoder, self.kernels
        column = self.generated
        self.positions = self.positions + 1
        prompt_of_row = self.slots // self.group  # [N]
        scale = dec.head_dim ** -0.5
        hidden = F.embedding(token_ids, dec.embed)  # [N, D], a fresh tensor: added to in place
        normed = kernels.rms_norm(hidden, dec.layers[0].input_norm, dec.eps)
        norms_after = [layer.input_norm for layer in dec.layers[1:]] + [dec.norm]
        for index, (layer, next_norm) in enumerate(zip(dec.layers, norms_after)):
            qkv = linear(normed, layer.qkv, layer.qkv_bias)  # [N, (H + 2 Hkv) d]
            attended = kernels.decode_attention(
                qkv, self.cos, self.sin, self.positions, prompt_of_row, self.slots,
                self.prompt_mask,
                self.prompt_keys[index], self.prompt_values[index], self.keys[index],
                self.values[index], column, dec.heads, scale)
            normed = kernels.add_rms_norm(hidden, linear(attended, layer.o, layer.o_bias),
                                          layer.post_norm, dec.eps)
            gate_up = linear(normed, layer.gate_up, layer.gate_up_bias)  # [N, 2 I]
            down = linear(kernels.silu_mul(gate_up), layer.down, layer.down_bias)
            normed = kernels.add_rms_norm(hidden, down, next_norm, dec.eps)
        self.generated = column + 1
        return linear(normed, dec.lm_head, dec.lm_head_bias)

    def _step_attention(self, q, keys, values, mask, scale):
        """q [N, 1, H, d]; keys (the prompts' [n, Hkv, d, S], the rows' own [N, Hkv, T, d]),
        values ([n, Hkv, S, d], [N, Hkv, T, d]); additive mask [N, S + T] -> [N, 1, H d].

        Query heads sharing a KV head are rows of one matmul, and the G rows of a prompt are
        rows of one matmul against its keys, so each key is read once per step. Softmax runs
        in float32 over both parts at once, as in transformers."""
        (prompt_k, own_k), (prompt_v, own_v) = keys, values
        rows, _, h, d = q.shape
        prompts, kv, _, span = prompt_k.shape
        g, group = h // kv, self.group
        grouped = q.reshape(rows, kv, g, d)
        by_prompt = self._to_slots(grouped).view(prompts, group, kv, g, d).transpose(1, 2)
        scores = torch.matmul(by_prompt.reshape(prompts, kv, group * g, d), prompt_k)
        scores = self._from_slots(scores.view(prompts, kv, group, g, span).transpose(1, 2)
                                  .reshape(prompts * group, kv, g, span))  # [N, Hkv, g, S]
        scores = torch.cat([scores, torch.matmul(grouped, own_k.transpose(-1, -2))], dim=-1)
        probs = torch.softmax(scores.float() * scale + mask[:, None, None], dim=-1).to(own_v.dtype)
        prompt_probs = self._to_slots(probs[..., :span]).view(prompts, group, kv, g, span)
        out = torch.matmul(prompt_probs.transpose(1, 2).reshape(prompts, kv, group * g, span),
                           prompt_v)  # [n, Hkv, G g, d]
        out = self._from_slots(out.view(prompts, kv, group, g, d).transpose(1, 2)
                               .reshape(prompts * group, kv, g, d))
        out = out + torch.matmul(probs[..., span:], own_v)  # [N, Hkv, g, d]
        return out.reshape(rows, 1, h * d)

    @property
    def all_slots(self) -> bool:
        """No row has left, so row r is slot r (`select` keeps sorted, distinct rows)."""
        return len(self.slots) == len(self.prompt_mask) * self.group

    def _to_slots(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] per batch row -> [n G, ...] per slot (the slots of rows that left: zeros)."""
        if self.all_slots:
            return x
        slotted = x.new_zeros((len(self.prompt_mask) * self.group, *x.shape[1:]))
        return slotted.index_copy_(0, self.slots, x)

    def _from_slots(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.all_slots else x.index_select(0, self.slots)

    def select(self, keep: torch.Tensor) -> None:
        """Keep only batch rows `keep` (sorted indices). The native step reads each row's own
        cache at its slot, so nothing is copied when rows leave; the torch step's products read
        the rows' caches whole, so they are compacted."""
        if self.kernels is None:
            self.keys = [k.index_select(0, keep) for k in self.keys]
            self.values = [v.index_select(0, keep) for v in self.values]
        self.slots, self.positions = self.slots[keep], self.positions[keep]
