"""The lean decoder's layers: the mathematics of the supported blocks (capability.py) on
`LeanDecoder` weights.

`decoder_layers` runs every block on hidden states [N, T, D] with the caller's attention and
KV store, so the decode step (decoding.LeanStepper), the prompts' prefill and the re-test's
teacher-forced drift (scoring.LeanScorer) share one implementation. `forward_tokens` runs many
token rows at once, under any mask and positions, in a way that keeps each row's numbers
independent of the rows beside it — the property that lets a prompt compute the same bits
whichever batch or rank it lands in; `forward_rows` lays out padded prompts for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grpogate.engines.cpu.weights import LeanDecoder, linear
from grpogate.engines.rows import WIDTH_BUCKET, round_up

MASKED = -1e30  # additive attention mask; finite, so an all-masked (padding) query stays finite


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As the supported decoder's RMSNorm in transformers (capability.py): normalize in
    float32, scale in the model dtype."""
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
    are stored transposed, [d, L] per head, so the score matmul reads them as stored instead of
    transposing [L, d] keys at every call (docs/measurements.md, "Figures moved from code
    comments"). Softmax runs in float32, as in transformers.
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

    The CPU's matmul kernels (oneDNN's bfloat16 ones among them) round a row differently at
    another row count (docs/measurements.md, "Figures moved from code comments"), but at one
    row count a row's result depends neither on its place nor on the other rows; so with every
    product `tile` rows, a row computes the same numbers in any batch."""
    flat = x.reshape(-1, x.shape[-1])
    count = flat.shape[0]
    whole = count - count % tile
    pieces = [linear(flat[i:i + tile], weight, bias) for i in range(0, whole, tile)]
    if whole < count:  # only the last tile is copied, to be padded
        last = torch.cat([flat[whole:], flat.new_zeros(tile - (count - whole), flat.shape[1])])
        pieces.append(linear(last, weight, bias)[:count - whole])
    out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return out.view(*x.shape[:-1], out.shape[-1])


def chunks_by_shape(shapes: list, size=lambda shape: PROMPTS_PER_FORWARD) -> list[list[int]]:
    """Indices of the items, grouped by equal shape (any hashable key) and cut into chunks of at
    most `size(shape)` (default PROMPTS_PER_FORWARD): the batches `forward_tokens` computes
    without one item's numbers depending on another's."""
    groups: dict = {}
    for index, shape in enumerate(shapes):
        groups.setdefault(shape, []).append(index)
    return [members[first:first + size(shape)] for shape, members in groups.items()
            for first in range(0, len(members), size(shape))]


def prefix_forward(decoder: LeanDecoder, prefix: list[int]):
    """The prefix every prompt of a set shares (system prompt, chat template), alone at batch
    1 -> its cache as `forward_rows` returns it. Its products run in one tile of its own padded
    width (64 rows for SmolLM2's 62-token prefix) instead of ROW_TILE: the caller fixes the
    prefix over the whole prompt set, so every batch and rank computes it at that one row
    count and gets the same numbers, and half the default's products go (128 -> 64 rows)."""
    return forward_rows(decoder, [prefix], [0], None, keep=True,
                        tile=round_up(len(prefix), WIDTH_BUCKET))[1]


def forward_rows(decoder: LeanDecoder, rows: list[list[int]], starts: list[int], cache,
                 keep: bool = False, pad_id: int = 0, owner: torch.Tensor | None = None,
                 tile: int = ROW_TILE):
    """Token rows through the decoder at once, every product in `tiled_linear`'s tiles: rows
    padded to a WIDTH_BUCKET multiple (left with `keep`, else right), row r's first token at
    position starts[r], attending to its `owner[r]`'s entry of `cache` (every row to the one
    entry without `owner`) -> (hidden [n, W, D], with `keep` the cache extended by the rows'
    own keys [n, Hkv, d, C], values [n, Hkv, C, d] and additive mask [n, C], else None).

    Batched prompts' numbers depend on their padded width alone, not on which prompts share
    the forward (the tiles above; attention is one product per row): the prefill of sampling
    runs it; the re-test's teacher-forced drift runs `forward_tokens` on packed rows."""
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
    hidden, extended = forward_tokens(decoder, ids, torch.tensor(starts, device=device)[:, None]
                                      + offsets, causal_mask(real), cache, owner, keep, tile)
    if not keep:
        return hidden, None
    keys, values, earlier_mask = extended
    own_mask = torch.where(real.bool(), 0.0, MASKED)
    return hidden, (keys, values, own_mask if earlier_mask is None else
                    torch.cat([earlier_mask, own_mask], dim=-1))


def forward_tokens(decoder: LeanDecoder, ids: torch.Tensor, positions: torch.Tensor,
                   mask: torch.Tensor, cache, owner: torch.Tensor | None = None,
                   keep: bool = False, tile: int = ROW_TILE):
    """Token ids [n, W] at `positions` [n, W] through the decoder, attending among themselves
    by the additive `mask` [n, W, W] and to `cache` (keys, values, mask as `forward_rows`
    returns them; row r reads its `owner[r]`'s entry, every row the one entry without
    `owner`) -> (hidden [n, W, D], with `keep` (every layer's keys, values, the cache's mask
    for these rows or None) else None). Every product in `tiled_linear`'s tiles of `tile` rows."""
    n, width = ids.shape
    device = decoder.embed.device
    cos, sin = decoder.rotary(decoder.embed[:1], positions)

    def earlier(tensor):
        return tensor.expand(n, *tensor.shape[1:]) if owner is None else tensor[owner]

    if cache is not None:
        mask = torch.cat([earlier(cache[2])[:, None].expand(-1, width, -1), mask], dim=-1)
    keys, values = [], []

    def attend(index, k, v):
        k_t, v = k.permute(0, 2, 3, 1), v.transpose(1, 2)
        if cache is not None:
            k_t = torch.cat([earlier(cache[0][index]), k_t], dim=-1)
            v = torch.cat([earlier(cache[1][index]), v], dim=-2)
        if keep:
            keys.append(k_t)
            values.append(v)
        return k_t, v

    hidden = decoder_layers(decoder, F.embedding(ids.to(device), decoder.embed), cos[:, :, None],
                            sin[:, :, None], mask, attend,
                            lambda x, weight, bias: tiled_linear(x, weight, bias, tile))
    if not keep:
        return hidden, None
    return hidden, (keys, values, None if cache is None else earlier(cache[2]))
