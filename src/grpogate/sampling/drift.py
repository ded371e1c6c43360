"""How far the update moved the policy, measured on the re-test's fresh completions.

For every candidate completion: the mean over its tokens of the exact KL(candidate || baseline)
of the next-token distributions, sum_v p_c(v) (log p_c(v) - log p_b(v)), each softmax(logits /
temperature) — the distribution the re-test samples from (top_k / top_p / min_p off, the
default). Exact rather than the k3 estimate the update's per-step KL uses: both have the same
expectation on the candidate's own samples, but with the full distributions at hand the exact
value carries no per-token sampling noise. For every completion of either policy: that policy's
own mean per-token entropy (before / after). `evidence/guard.py` reduces the per-completion
values to the run's token-weighted means.

Forward passes only, no gradient, with each policy's LoRA merged (`sampling_weights`): a few
prompts' completions are forwarded under the candidate, then the baseline, so only their full
distributions are held at a time; on the lean scorer each policy's weights are merged and
packed once (measured: 7 preparations, 1.6 s of a 12.4 s drift at 48 prompts x 4, before).
On the lean decoder's weights (Llama, Qwen2: scoring.LeanScorer) the prefix every eval prompt
shares is forwarded once per policy, each prompt and its completions packed into one row (the
prompt's tokens once, no completion padded to its siblings' length), and the LM head runs on
completion positions only; other architectures take the model's forward, one prompt's
completions per forward.
"""

from __future__ import annotations

import torch

from grpogate.inputs.policy import Policy, sampling_weights
from grpogate.sampling.decoding import (WIDTH_BUCKET, cache_keyword, round_up,
                                       shared_prefix_length)
from grpogate.sampling.lean_weights import lean_decoder
from grpogate.sampling.native import native_kernels
from grpogate.sampling.scoring import LeanScorer

# Prompts whose logits (the model's dtype) are held between the candidate's and the baseline's
# forwards: 16 groups x G 4 x ~14 tokens x 49k bfloat16 is about 90 MB (48 tokens: 300 MB).
SWAP_GROUPS = 16


def _logit_rows(model, completions: list, pad_id: int) -> list[torch.Tensor]:
    """One [tokens_i, V] tensor of next-token logits per completion, at the positions that
    predict its tokens. The prefix every prompt shares (system prompt, chat
    template: most of a re-test prompt) is forwarded once and its KV cache repeated for the
    batch; each sequence's rest (prompt suffix + completion) follows, right-padded."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    shared = shared_prefix_length([list(c.prompt_token_ids) for c in completions])
    rests = [list(c.prompt_token_ids[shared:]) + list(c.completion_token_ids)
             for c in completions]
    width = round_up(max(len(r) for r in rests), WIDTH_BUCKET)
    ids = torch.full((len(rests), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rests), shared + width), dtype=torch.long)
    mask[:, :shared] = 1
    for row, rest in enumerate(rests):
        ids[row, :len(rest)] = torch.tensor(rest, dtype=torch.long)
        mask[row, shared:shared + len(rest)] = 1
    extra = {}
    if shared:
        extra = {cache_keyword(model): DynamicCache(config=model.config)}
        prefix = torch.tensor([list(completions[0].prompt_token_ids[:shared])], device=device)
        model(input_ids=prefix, use_cache=True, logits_to_keep=1, **extra)
        extra[cache_keyword(model)].batch_repeat_interleave(len(rests))
    positions = shared + torch.arange(width, device=device)[None].expand(len(rests), -1)
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                   position_ids=positions, use_cache=bool(shared), **extra).logits
    rows = []
    for row, completion in enumerate(completions):
        # Completion token j sits at rest column len(suffix) + j, predicted one column before.
        first = len(completion.prompt_token_ids) - shared - 1
        rows.append(logits[row, first:first + len(completion.completion_token_ids)])
    return rows


def _policy_rows(policy: Policy, baseline: bool, pad_id: int, prefix: list[int]):
    """groups -> their completions' next-token logits in order, under the baseline's or the
    candidate's weights whenever called. On the lean scorer (the shared `prefix` forwarded once),
    built here under those weights once: it keeps its own fused copies and references, valid
    after the merged tensors are swapped back. Else the model's forward, one prompt at a time,
    with the policy's LoRA merged for each call."""
    model = policy.model
    with sampling_weights(policy, baseline=baseline):
        decoder = lean_decoder(model)
        scorer = None if decoder is None else LeanScorer(decoder, prefix)
    if scorer is None:
        def model_rows(groups: list[list]) -> list[torch.Tensor]:
            with sampling_weights(policy, baseline=baseline):
                return [r for group in groups for r in _logit_rows(model, group, pad_id)]

        return model_rows

    def rows(groups: list[list]) -> list[torch.Tensor]:
        scored = scorer.score([(list(group[0].prompt_token_ids[len(prefix):]),
                                [list(c.completion_token_ids) for c in group])
                               for group in groups], pad_id)
        return [x for logits in scored for x in logits]

    return rows


def _values(own: torch.Tensor, base: torch.Tensor | None, temperature: float) -> dict:
    """A completion's logits [tokens, V] under its policy (and the baseline's, for a candidate
    completion) -> {"entropy"} (and "kl_to_baseline"): means over its tokens of p's entropy and
    of KL(p || q), p and q the softmax(logits / temperature). On the native kernel where it
    covers the dtype (two reads of each row, no float32 copy), else in torch."""
    kernels = native_kernels(own.dtype, own.device)
    if base is None:
        if kernels is not None and own.numel():
            return {"entropy": _mean(kernels.row_logsumexp(own.contiguous(), temperature,
                                                           entropy=True)[1])}
        return {"entropy": _mean(_entropy(_log_softmax(own, temperature)))}
    if kernels is not None and own.numel():
        kl, entropy = kernels.row_kl(own.contiguous(), base.contiguous(), temperature)
    else:
        mine, reference = _log_softmax(own, temperature), _log_softmax(base, temperature)
        kl, entropy = (mine.exp() * (mine - reference)).sum(-1), _entropy(mine)
    return {"entropy": _mean(entropy), "kl_to_baseline": _mean(kl)}


def _log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def _entropy(log_probs: torch.Tensor) -> torch.Tensor:
    return -(log_probs.exp() * log_probs).sum(-1)


def _groups(completions: list) -> list[list]:
    """Consecutive completions of one prompt (the re-test samples G per prompt in order)."""
    groups: list[list] = []
    for completion in completions:
        if groups and groups[-1][0].prompt_index == completion.prompt_index:
            groups[-1].append(completion)
        else:
            groups.append([completion])
    return groups


@torch.no_grad()
def measure_drift(policy: Policy, baseline: list, candidate: list, temperature: float,
                  shared_prefix: int | None = None) -> tuple[list[dict], list[dict]]:
    """({"entropy"} per baseline completion, {"entropy", "kl_to_baseline"} per candidate
    completion), each a mean over the completion's tokens (0.0 for an empty completion).

    A completion's values never depend on which other prompts a process re-tests (one prompt
    per forward of the model, prompts of one shape per lean forward): one process and a
    torchrun shard record the same numbers. On the lean scorer each policy's LoRA is merged
    once; on the model's forward, once per SWAP_GROUPS prompts and policy. `shared_prefix`:
    the prefix length the lean forward computes once, fixed over the caller's whole prompt set
    as in sampling (default: what every completion's prompt shares)."""
    pad_id = policy.tokenizer.pad_token_id
    if pad_id is None:
        pad_id = policy.tokenizer.eos_token_id
    everything = baseline + candidate
    if not everything:
        return [], []
    prompts = [list(c.prompt_token_ids) for c in everything]
    shared = shared_prefix_length(prompts)
    prefix = prompts[0][:shared if shared_prefix is None else min(shared_prefix, shared)]

    base_rows = _policy_rows(policy, True, pad_id, prefix)
    own_rows = _policy_rows(policy, False, pad_id, prefix)
    baseline_values, candidate_values = [], []
    groups = _groups(baseline)
    for start in range(0, len(groups), SWAP_GROUPS):
        baseline_values += [_values(r, None, temperature)
                            for r in base_rows(groups[start:start + SWAP_GROUPS])]
    groups = _groups(candidate)
    for start in range(0, len(groups), SWAP_GROUPS):
        chunk = groups[start:start + SWAP_GROUPS]
        candidate_values += [_values(own, base, temperature)
                             for own, base in zip(own_rows(chunk), base_rows(chunk))]
    return baseline_values, candidate_values


def _mean(values: torch.Tensor) -> float:
    return float(values.double().mean()) if values.numel() else 0.0
