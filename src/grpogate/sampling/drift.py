"""How far the update moved the policy, measured on the re-test's fresh completions.

For every candidate completion: the mean over its tokens of the exact KL(candidate || baseline)
of the next-token distributions, sum_v p_c(v) (log p_c(v) - log p_b(v)), each softmax(logits /
temperature) — the distribution the re-test samples from (top_k / top_p / min_p off, the
default). Exact rather than the k3 estimate the update's per-step KL uses: both have the same
expectation on the candidate's own samples, but with the full distributions at hand the exact
value carries no per-token sampling noise. For every completion of either policy: that policy's
own mean per-token entropy (before / after). `evidence/guard.py` reduces the per-completion
values to the run's token-weighted means.

The re-test measures these while the policies sample where the engine's decode stepper holds
its own copy of the weights (`DriftStepper`, at the end of this module: the sampler's own
logits, and a baseline stepper in lockstep for the KL). `measure_drift` measures given
completions teacher-forced through the engine's scorer (engines.Engine.scorer): the path of
the reference engine, and the reference the lockstep measurement is tested against. Forward
passes only, no gradient, with each policy's LoRA merged (`sampling_weights`): a few prompts'
completions are forwarded under the candidate, then the baseline, so only their full
distributions are held at a time. `_row_values` is the one function that turns logits into
the reported entropies and KLs, for both paths.
"""

from __future__ import annotations

import torch

from grpogate.inputs.policy import Policy, sampling_weights
from grpogate.engines import engine_for, row_kernels
from grpogate.engines.rows import shared_prefix_length

# Prompts whose logits (the model's dtype) are held between the candidate's and the baseline's
# forwards: 16 groups x G 4 x ~14 tokens x 49k bfloat16 is about 90 MB (48 tokens: 300 MB).
SWAP_GROUPS = 16


def _policy_rows(policy: Policy, baseline: bool, pad_id: int, prefix: list[int]):
    """groups -> their completions' next-token logits in order, under the baseline's or the
    candidate's weights whenever called: the engine's scorer, built under those weights. One
    that holds its own copy of them (the accelerator's, `prefix` forwarded once) is built once;
    one that reads the model's weights runs with the policy's LoRA merged for each call."""
    model = policy.model
    engine = engine_for(model)
    with sampling_weights(policy, baseline=baseline):
        scorer = engine.scorer(model, prefix)

    def rows(groups: list[list]) -> list[torch.Tensor]:
        pairs = [(list(group[0].prompt_token_ids), [list(c.completion_token_ids) for c in group])
                 for group in groups]
        if scorer.holds_weights:
            scored = scorer(pairs, pad_id)
        else:
            with sampling_weights(policy, baseline=baseline):
                scored = scorer(pairs, pad_id)
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
    kernels = row_kernels(own.dtype, own.device)
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
