"""How far the update moved the policy, measured on the re-test's fresh completions.

For every candidate completion: the mean over its tokens of the exact KL(candidate || baseline)
of the next-token distributions, sum_v p_c(v) (log p_c(v) - log p_b(v)), each softmax(logits /
temperature) — the distribution the re-test samples from (top_k / top_p / min_p off, the
default). Exact rather than the k3 estimate the update's per-step KL uses: both have the same
expectation on the candidate's own samples, but with the full distributions at hand the exact
value carries no per-token sampling noise. For every completion of either policy: that policy's
own mean per-token entropy (before / after). `evidence/guard.py` reduces the per-completion
values to the run's token-weighted means.

The re-test measures these while the policies sample (`DriftStepper`, at the end of this
module: the sampler's own logits, and a baseline stepper in lockstep for the KL). What follows
is `measure_drift`, the teacher-forced measurement of given completions that other
architectures take, and the reference the lockstep one is tested against.

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
    of KL(p || q), p and q the softmax(logits / temperature)."""
    entropy, kl = _row_values(own, base, temperature)
    return {"entropy": _mean(entropy)} if kl is None else {"entropy": _mean(entropy),
                                                            "kl_to_baseline": _mean(kl)}


def _row_values(own: torch.Tensor, base: torch.Tensor | None, temperature: float
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [R, V] under a policy (and the baseline's at the same positions) -> float32 [R]
    entropies of p and, with `base`, KL(p || q) per row, p and q the softmax(logits /
    temperature). On the native kernel where it covers the dtype (two reads of each row, no
    float32 copy), else in torch."""
    kernels = native_kernels(own.dtype, own.device)
    if kernels is not None and own.numel():
        if base is None:
            return kernels.row_logsumexp(own.contiguous(), temperature, entropy=True)[1], None
        kl, entropy = kernels.row_kl(own.contiguous(), base.contiguous(), temperature)
        return entropy, kl
    mine = _log_softmax(own, temperature)
    if base is None:
        return _entropy(mine), None
    return _entropy(mine), (mine.exp() * (mine - _log_softmax(base, temperature))).sum(-1)


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


class DriftStepper:
    """A decode stepper that measures the drift on the distributions it samples from.

    It wraps the sampling policy's stepper and, on every next-token logits it hands the sampler
    (the prefill's, then each step's), computes each row's entropy of softmax(logits /
    temperature) and, given `baseline` (a second lean stepper on the baseline's weights, fed the
    same tokens and row drops in lockstep), the exact KL(policy || baseline) at the same
    position. `measured(row, tokens)` is a completion's mean over its tokens, what
    `measure_drift` computes with a teacher-forced forward afterwards: here the policy's own
    forward is the one that sampled, and the baseline's runs as a decode step instead of a
    second pass over the completions. A row's values depend on that row alone, as its tokens
    do (world-size invariance; the decode step's products are row-independent at every row
    count it runs). Rows that finished but ride along in the batch get values past their
    completion's end, which `measured` never reads."""

    def __init__(self, stepper, temperature: float, baseline=None):
        self.stepper, self.baseline, self.temperature = stepper, baseline, temperature
        self.name = stepper.name

    def prefill(self, prompts: list[list[int]], pad_id: int, group_size: int,
                max_new_tokens: int, shared: int | None = None) -> torch.Tensor:
        logits = self.stepper.prefill(prompts, pad_id, group_size, max_new_tokens, shared)
        rows = len(logits)
        self.slots, self.column = torch.arange(rows), 0  # the batch rows' prefill rows
        self.entropy = torch.zeros((rows, max_new_tokens))  # [N, T] per generated position
        self.kl = torch.zeros((rows, max_new_tokens)) if self.baseline is not None else None
        base = (None if self.baseline is None else
                self.baseline.prefill(prompts, pad_id, group_size, max_new_tokens, shared))
        self._record(logits, base)
        return logits

    def step(self, token_ids: torch.Tensor) -> torch.Tensor:
        logits = self.stepper.step(token_ids)
        base = None if self.baseline is None else self.baseline.step(token_ids)
        self.column += 1
        self._record(logits, base)
        return logits

    def select(self, keep: torch.Tensor) -> None:
        self.stepper.select(keep)
        if self.baseline is not None:
            self.baseline.select(keep)
        self.slots = self.slots[keep.cpu()]

    def _record(self, logits: torch.Tensor, base: torch.Tensor | None) -> None:
        entropy, kl = _row_values(logits, base, self.temperature)
        self.entropy[self.slots, self.column] = entropy.float().cpu()
        if kl is not None:
            self.kl[self.slots, self.column] = kl.float().cpu()

    def measured(self, row: int, tokens: int) -> dict:
        """Prefill row `row`'s completion of `tokens` tokens, of the last batch -> {"entropy"}
        (and "kl_to_baseline"), means over its tokens (0.0 for none)."""
        values = {"entropy": _mean(self.entropy[row, :tokens])}
        if self.kl is not None:
            values["kl_to_baseline"] = _mean(self.kl[row, :tokens])
        return values
