"""The decode forwards that sampling runs: the model's own, and a lean one for the Llama family.

Both are "steppers" with one interface: prefill(prompts) -> logits, step(tokens) -> logits,
select(rows) when finished rows leave the batch. `ModelStepper` calls the model's forward with a
transformers cache and works for any architecture. At decode time that forward spends about as
long around the matrix products as in them (measured on SmolLM2 at batch 64: per-layer dtype
copies, a KV cache grown by torch.cat each step, SDPA on a one-token query), so `LeanStepper` runs
the same mathematics for Llama and Qwen2 directly on the model's weight tensors, as they are at
the moment of the call:

- q/k/v and gate/up are fused into one matrix product each (5 products per layer become 2),
- the KV cache is allocated once for the whole rollout and written in place, each prompt's
  part once (not once per sampled row) and each row's generated part,
- grouped-query attention is batched matmuls (K/V never repeated per head, a prompt's keys
  read once per step for all its G rows),
- the prompts' common prefix (system prompt, chat template) is prefilled once, at batch 1,
  and the prompts' own tokens in batches whose products have one row count (`forward_rows`),
- cos/sin tables come from the model's own rotary module, once per rollout,
- on a CPU with oneDNN bfloat16 kernels, every weight is reordered once per rollout into the
  kernel's blocked layout ("prepacked"), so a decode step no longer reorders 270 MB of weights
  per call (measured on SmolLM2, all 211 products: 12.4 -> 8.5 ms at 8 rows, 29.4 -> 24.4 ms at
  64; the results are bit-identical).

`lean_decoder(model)` (lean_weights.py, which holds the fused and prepacked weights) returns
None for anything it does not cover (another architecture, a sliding window, a length-dependent
RoPE, LoRA layers that are active and unmerged, forward hooks), and the rollout then uses
`ModelStepper`. Tests compare both paths' logits.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from grpogate.sampling.lean_weights import LeanDecoder, lean_decoder, linear

MASKED = -1e30  # additive attention mask; finite, so an all-masked (padding) query stays finite

# bfloat16 matmuls on the CPU go through oneDNN, which builds a kernel for every new matrix shape
# (seconds of warm-up spread over a run). Batch rows and prompt widths are therefore rounded
# up to these multiples so that a run sees a handful of shapes, not hundreds.
ROW_BUCKET = 8
WIDTH_BUCKET = 16


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def left_pad(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and attention mask [N, W], W rounded up to WIDTH_BUCKET, sequences flush right."""
    width = round_up(max(len(s) for s in sequences), WIDTH_BUCKET)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, width - len(sequence):] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, width - len(sequence):] = 1
    return input_ids.to(device), attention_mask.to(device)


def cache_keyword(model) -> str:
    """transformers 5 calls the KV cache argument `cache`; 4.x called it `past_key_values`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


class ModelStepper:
    """The model's own forward with a transformers DynamicCache: the path for any architecture.

    Same interface as `LeanStepper`: prefill -> logits [N, V], step(tokens) -> logits,
    select(rows). The prompt is prefilled once and its KV cache repeated G times.
    """

    name = "model-forward"  # recorded in the evidence: which forward produced the samples

    def __init__(self, model):
        self.model = model
        self.keyword = cache_keyword(model)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], pad_id: int, group_size: int,
                max_new_tokens: int, shared: int | None = None) -> torch.Tensor:
        from transformers import DynamicCache

        input_ids, attention_mask = left_pad(prompts, pad_id, self.model.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = DynamicCache(config=self.model.config)
        output = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=True, logits_to_keep=1,
                            **{self.keyword: self.cache})
        self.cache.batch_repeat_interleave(group_size)
        self.attention_mask = attention_mask.repeat_interleave(group_size, dim=0)  # [N, P]
        self.positions = position_ids[:, -1].repeat_interleave(group_size, dim=0)  # [N]
        return output.logits[:, -1].repeat_interleave(group_size, dim=0)  # [N, V]

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor) -> torch.Tensor:
        mask = self.attention_mask
        self.attention_mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
        self.positions = self.positions + 1
        output = self.model(input_ids=token_ids[:, None], attention_mask=self.attention_mask,
                            position_ids=self.positions[:, None], use_cache=True,
                            logits_to_keep=1, **{self.keyword: self.cache})
        return output.logits[:, -1]

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.attention_mask, self.positions = self.attention_mask[keep], self.positions[keep]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' Llama/Qwen2 RMSNorm: normalize in float32, scale in the model dtype."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in transformers' layout (halves, not interleaved pairs); cos/sin [N, T, 1, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _attention(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
    """q [N, T, H, d], keys_t [N, Hkv, d, L], values [N, Hkv, L, d], additive mask [N, T, L]
    -> [N, T, H d].

    Query heads sharing a KV head are stacked as rows of one matmul, so K/V are read once. Keys
    are stored transposed, [d, L] per head, so the score matmul reads them as stored (measured
    on the bench rollout: 760 against 690 tokens/s when transposing [L, d] keys). Softmax runs
    in float32, as in transformers.
    """
    n, t, h, d = q.shape
    kv_heads, length = keys_t.shape[1], keys_t.shape[3]
    g = h // kv_heads
    grouped = q.reshape(n, t, kv_heads, g, d).permute(0, 2, 3, 1, 4).reshape(n, kv_heads, g * t, d)
    scores = torch.matmul(grouped, keys_t).float()  # [N, Hkv, g T, L]
    scores = scores.view(n, kv_heads, g, t, length) * scale + mask[:, None, None]
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(n, kv_heads, g * t, length)
    out = torch.matmul(probs, values)  # [N, Hkv, g T, d]
    return out.view(n, kv_heads, g, t, d).permute(0, 3, 1, 2, 4).reshape(n, t, h * d)


def decoder_layers(decoder: LeanDecoder, hidden: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, mask: torch.Tensor, attend, linear=linear,
                   attention=_attention) -> torch.Tensor:
    """hidden [N, T, D] through every block; attend(i, k, v) -> (keys, values) layer i reads,
    `attention(q, keys, values, mask, scale)` reads them (default: keys transposed [N, Hkv, d,
    L], values [N, Hkv, L, d]); `linear(x, weight, bias)` runs the matrix products."""
    n, t, _ = hidden.shape
    h, kv, d, inter = decoder.heads, decoder.kv_heads, decoder.head_dim, decoder.intermediate
    scale = d ** -0.5
    for index, layer in enumerate(decoder.layers):
        x = _rms_norm(hidden, layer.input_norm, decoder.eps)
        qkv = linear(x, layer.qkv, layer.qkv_bias)  # [N, T, (H + 2 Hkv) d]
        qk = _rotate(qkv[..., :(h + kv) * d].view(n, t, h + kv, d), cos, sin)
        keys_t, values = attend(index, qk[:, :, h:], qkv[..., (h + kv) * d:].view(n, t, kv, d))
        attended = attention(qk[:, :, :h], keys_t, values, mask, scale)
        hidden = hidden + linear(attended, layer.o, layer.o_bias)
        gate_up = linear(_rms_norm(hidden, layer.post_norm, decoder.eps), layer.gate_up,
                         layer.gate_up_bias)  # [N, T, 2 I]
        hidden = hidden + linear(F.silu(gate_up[..., :inter]) * gate_up[..., inter:],
                                 layer.down, layer.down_bias)
    return hidden


def causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, T] (1 real, 0 padding) -> additive mask [b, T, T]: causal, padding keys masked.

    A padding query still attends to itself, so its (unused) output stays finite.
    """
    width = attention_mask.shape[1]
    causal = torch.full((width, width), MASKED, device=attention_mask.device).triu(1)
    padding = torch.where(attention_mask.bool(), 0.0, MASKED)
    mask = (padding[:, None, :] + causal).clamp(min=MASKED)
    mask.diagonal(dim1=-2, dim2=-1).zero_()
    return mask


def decoder_logits(decoder: LeanDecoder, hidden_last: torch.Tensor,
                   linear=linear) -> torch.Tensor:
    return linear(_rms_norm(hidden_last, decoder.norm, decoder.eps), decoder.lm_head,
                  decoder.lm_head_bias)


ROW_TILE = 128  # rows per matrix product of a batched prompt forward (`tiled_linear`)
PROMPTS_PER_FORWARD = 16  # prompts of one padded width per batched forward


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 tile: int = ROW_TILE) -> torch.Tensor:
    """`linear` on x's rows in products of exactly `tile` rows (the last one zero-padded).

    The CPU's matmul kernels round a row differently at another row count (measured with
    oneDNN's bfloat16 kernels: a row's result at 16 rows differs from the same row's at 48, 64
    or 256), but at one row count a row's result depends neither on its place nor on the other
    rows; so with every product `tile` rows, a row computes the same numbers in any batch."""
    flat = x.reshape(-1, x.shape[-1])
    count = flat.shape[0]
    whole = count - count % tile
    pieces = [linear(flat[i:i + tile], weight, bias) for i in range(0, whole, tile)]
    if whole < count:  # only the last tile is copied, to be padded
        last = torch.cat([flat[whole:], flat.new_zeros(tile - (count - whole), flat.shape[1])])
        pieces.append(linear(last, weight, bias)[:count - whole])
    out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return out.view(*x.shape[:-1], out.shape[-1])


def forward_rows(decoder: LeanDecoder, rows: list[list[int]], starts: list[int], cache,
                 keep: bool = False, pad_id: int = 0, owner: torch.Tensor | None = None):
    """Token rows through the decoder at once, every product in `tiled_linear`'s tiles: rows
    padded to a WIDTH_BUCKET multiple (left with `keep`, else right), row r's first token at
    position starts[r], attending to its `owner[r]`'s entry of `cache` (every row to the one
    entry without `owner`) -> (hidden [n, W, D], with `keep` the cache extended by the rows'
    own keys [n, Hkv, d, C], values [n, Hkv, C, d] and additive mask [n, C], else None).

    Batched prompts' numbers depend on their padded width alone, not on which prompts share
    the forward (the tiles above; attention is one product per row): the prefill of sampling
    and the re-test's teacher-forced drift both run it."""
    n = len(rows)
    device = decoder.embed.device
    width = round_up(max(len(r) for r in rows), WIDTH_BUCKET)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    real = torch.zeros((n, width), dtype=torch.long)
    for row, tokens in enumerate(rows):
        where = slice(width - len(tokens), width) if keep else slice(0, len(tokens))
        ids[row, where] = torch.tensor(tokens, dtype=torch.long)
        real[row, where] = 1
    real = real.to(device)
    offsets = (real.cumsum(-1) - 1).clamp(min=0) if keep else torch.arange(width, device=device)
    cos, sin = decoder.rotary(decoder.embed[:1],
                              torch.tensor(starts, device=device)[:, None] + offsets)

    def earlier(tensor):
        return tensor.expand(n, *tensor.shape[1:]) if owner is None else tensor[owner]

    mask = causal_mask(real)  # [n, W, W]
    if cache is not None:
        mask = torch.cat([earlier(cache[2])[:, None].expand(-1, width, -1), mask], dim=-1)
    keys, values = [], []

    def attend(index, k, v):
        k_t, v = k.permute(0, 2, 3, 1), v.transpose(1, 2)
        if cache is not None:
            k_t = torch.cat([earlier(cache[0][index]), k_t], dim=-1)
            v = torch.cat([earlier(cache[1][index]), v], dim=-2)
        keys.append(k_t)
        values.append(v)
        return k_t, v

    hidden = decoder_layers(decoder, F.embedding(ids.to(device), decoder.embed), cos[:, :, None],
                            sin[:, :, None], mask, attend, tiled_linear)
    if not keep:
        return hidden, None
    own_mask = torch.where(real.bool(), 0.0, MASKED)
    return hidden, (keys, values, own_mask if cache is None else
                    torch.cat([earlier(cache[2]), own_mask], dim=-1))


def shared_prefix_length(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with, leaving each at least one token of its own; rounded
    down to WIDTH_BUCKET so that the prefix's matmuls keep known shapes."""
    shortest = min(len(p) for p in prompts)
    length = 0
    while length < shortest - 1 and all(p[length] == prompts[0][length] for p in prompts):
        length += 1
    return length // WIDTH_BUCKET * WIDTH_BUCKET


class LeanStepper:
    """Prefill a batch of prompts once, then decode one token per call for G rows per prompt.

    The cache holds each prompt's part once, not once per row: keys transposed [n, Hkv, d, S]
    and values [n, Hkv, S, d] over the columns [shared prefix | the prompt's suffix,
    left-padded], S in all, with an additive mask [n, S] for the padding; and each row's own
    generated part, keys and values [N, Hkv, T, d]. The prefix the prompts have in common
    (system prompt and chat template, typically) is computed once at batch 1 (measured on the
    bench rollout: prefill 0.22 -> 0.15 s); the prompts' suffixes attend to it, forwarded
    together by `forward_rows` (`_prefill_suffixes`). A decode step attends a row to its
    prompt's part in one matrix product per prompt (its G rows' queries against keys read
    once, `_step_attention`) and to its own columns, one softmax over both. Reading the
    prompt's keys once per row, as a cache repeated G times does, made attention and cache
    writes about 40 % of a decode step at batch 64 (bf16 kernels: the prompt is 80 of 128
    columns there).
    Row r of the prefill's batch is slot r = prompt x G + sample; `slots` maps the rows still
    in the batch to theirs, since finished rows leave it (`select`).
    """

    name = "lean"

    def __init__(self, decoder: LeanDecoder):
        self.decoder = decoder

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
        suffixes = [p[shared:] for p in prompts]
        width = round_up(max(len(x) for x in suffixes), WIDTH_BUCKET)
        span = shared + width
        columns = torch.arange(span + max_new_tokens, device=device)[None]
        cos, sin = dec.rotary(dec.embed[:1], columns)
        self.cos, self.sin = cos[0], sin[0]  # [C, d]
        # Zeros, not empty: masked columns get probability 0, and 0 x NaN would still be NaN.
        self.prompt_keys, self.prompt_values, self.keys, self.values = (
            [torch.zeros(shape, dtype=dtype, device=device) for _ in dec.layers] for shape in (
                (len(prompts), dec.kv_heads, dec.head_dim, span),
                (len(prompts), dec.kv_heads, span, dec.head_dim),
                (len(prompts) * group_size, dec.kv_heads, max_new_tokens, dec.head_dim),
                (len(prompts) * group_size, dec.kv_heads, max_new_tokens, dec.head_dim)))

        prefix = None
        if shared:  # keys [1, Hkv, d, shared], values [1, Hkv, shared, d] -> every prompt
            prefix = forward_rows(dec, [prompts[0][:shared]], [0], None, keep=True)[1]
            for index in range(len(dec.layers)):
                self.prompt_keys[index][..., :shared] = prefix[0][index]
                self.prompt_values[index][:, :, :shared] = prefix[1][index]
        suffix_mask, last_logits = self._prefill_suffixes(suffixes, pad_id, shared, width,
                                                          prefix)
        self.prompt_mask = torch.full((len(prompts), span), MASKED, device=device)
        self.prompt_mask[:, :shared] = 0.0
        self.prompt_mask[:, shared:] = torch.where(suffix_mask.bool(), 0.0, MASKED)
        positions = shared + (suffix_mask.cumsum(-1) - 1).clamp(min=0)  # [n, W]
        self.positions = positions[:, -1].repeat_interleave(group_size, dim=0)  # [N]
        self.own_mask = torch.full((max_new_tokens,), MASKED, device=device)
        self.group, self.generated = group_size, 0
        self.slots = torch.arange(len(prompts) * group_size, device=device)
        return last_logits.repeat_interleave(group_size, dim=0)

    def _prefill_suffixes(self, suffixes, pad_id, shared, width, prefix):
        """Each prompt's own tokens attending to the prefix, its block flush right in the
        prompt's W columns: -> (real-token mask [n, W], next-token logits [n, V]).

        Prompts of one padded width go through `forward_rows` together, PROMPTS_PER_FORWARD at
        a time, so a prompt computes the same numbers whatever batch or rank it lands in
        (world-size invariance) without a forward of its own (measured with bf16 kernels:
        prefill of 64 prompts 2.4 -> 1.2 s, of 8 prompts 0.33 -> 0.22 s)."""
        dec = self.decoder
        device = dec.embed.device
        suffix_mask = torch.zeros((len(suffixes), width), dtype=torch.long, device=device)
        logits: list = [None] * len(suffixes)
        widths: dict[int, list[int]] = {}
        for i, suffix in enumerate(suffixes):
            widths.setdefault(round_up(len(suffix), WIDTH_BUCKET), []).append(i)
        for own, members in widths.items():
            for first in range(0, len(members), PROMPTS_PER_FORWARD):
                chunk = torch.tensor(members[first:first + PROMPTS_PER_FORWARD], device=device)
                hidden, (keys, values, mask) = forward_rows(
                    dec, [suffixes[i] for i in chunk.tolist()], [shared] * len(chunk), prefix,
                    keep=True, pad_id=pad_id)
                columns = slice(shared + width - own, shared + width)
                for index in range(len(dec.layers)):
                    self.prompt_keys[index][chunk, ..., columns] = keys[index][..., shared:]
                    self.prompt_values[index][chunk, :, columns] = values[index][:, :, shared:]
                suffix_mask[chunk, width - own:] = (mask[:, shared:] == 0).long()
                for i, row in zip(chunk.tolist(), decoder_logits(dec, hidden[:, -1],
                                                                 tiled_linear)):
                    logits[i] = row
        return suffix_mask, torch.stack(logits)

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [N] -> next-token logits [N, V]; their K/V go into the rows' next column."""
        column = self.generated
        self.positions = self.positions + 1
        cos, sin = self.cos[self.positions][:, None, None], self.sin[self.positions][:, None, None]

        def attend(index, k, v):  # k/v [N, 1, Hkv, d]
            self.keys[index][:, :, column] = k[:, 0]
            self.values[index][:, :, column] = v[:, 0]
            return ((self.prompt_keys[index], self.keys[index]),
                    (self.prompt_values[index], self.values[index]))

        # The rows' own part is read whole, its unwritten columns masked: a slice of it is a
        # strided operand that the bfloat16 product first copies (about 0.2 ms a layer at batch
        # 64), and over whole rollouts the two measured the same (550 vs 554 tokens/s); whole,
        # every step's products keep one shape.
        self.own_mask[column] = 0.0
        prompt_mask = self.prompt_mask[self.slots // self.group]  # [N, S]
        mask = torch.cat([prompt_mask, self.own_mask.expand(len(prompt_mask), -1)], dim=1)
        hidden = decoder_layers(self.decoder, F.embedding(token_ids[:, None], self.decoder.embed),
                                cos, sin, mask, attend, attention=self._step_attention)
        self.generated = column + 1
        return decoder_logits(self.decoder, hidden[:, -1])

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
        """Keep only batch rows `keep` (sorted indices) in the cache."""
        self.keys = [k.index_select(0, keep) for k in self.keys]
        self.values = [v.index_select(0, keep) for v in self.values]
        self.slots, self.positions = self.slots[keep], self.positions[keep]


def make_stepper(model, lean: bool = True, pack: bool = True):
    """The lean decoder where it covers the model, else the model's own forward."""
    decoder = lean_decoder(model, pack) if lean else None
    return LeanStepper(decoder) if decoder is not None else ModelStepper(model)
