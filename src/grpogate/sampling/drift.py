"""How far the update moved the policy, measured on the re-test's fresh completions.

For every candidate completion: the mean over its tokens of the exact KL(candidate || baseline)
of the next-token distributions, sum_v p_c(v) (log p_c(v) - log p_b(v)), each softmax(logits /
temperature) — the distribution the re-test samples from (top_k / top_p / min_p off, the
default). Exact rather than the k3 estimate the update's per-step KL uses: both have the same
expectation on the candidate's own samples, but with the full distributions at hand the exact
value carries no per-token sampling noise. For every completion of either policy: that policy's
own mean per-token entropy (before / after). `evidence/guard.py` reduces the per-completion
values to the run's token-weighted means.

Forward passes only, no gradient, with each policy's LoRA merged (`sampling_weights`); each
micro-batch is forwarded under the candidate, then the baseline, so no more than one batch of
full distributions is held at a time.
"""

from __future__ import annotations

import torch

from grpogate.inputs.policy import Policy, sampling_weights
from grpogate.sampling.decoding import left_pad

DRIFT_BATCH = 16  # sequences per forward: [16, ~110, 49k] bf16 logits are about 170 MB


def _log_softmax_rows(model, completions: list, pad_id: int, temperature: float
                      ) -> list[torch.Tensor]:
    """One [tokens_i, V] float32 log-softmax(logits / temperature) per completion, at the
    positions that predict its tokens (prompt + completion, left-padded, one forward)."""
    sequences = [list(c.prompt_token_ids) + list(c.completion_token_ids) for c in completions]
    ids, mask = left_pad(sequences, pad_id, next(model.parameters()).device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    longest = max(len(c.completion_token_ids) for c in completions)
    # The last `longest + 1` positions hold every completion's predicting positions.
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                   logits_to_keep=longest + 1).logits
    rows = []
    for row, completion in enumerate(completions):
        count = len(completion.completion_token_ids)
        # Flush right: token j is predicted at column -(count + 1) + j of the kept logits.
        picked = logits[row, logits.shape[1] - count - 1:logits.shape[1] - 1].float()
        rows.append(torch.log_softmax(picked / temperature, dim=-1))
    return rows


def _entropy(log_probs: torch.Tensor) -> torch.Tensor:
    return -(log_probs.exp() * log_probs).sum(-1)


@torch.no_grad()
def measure_drift(policy: Policy, baseline: list, candidate: list, temperature: float
                  ) -> tuple[list[dict], list[dict]]:
    """({"entropy"} per baseline completion, {"entropy", "kl_to_baseline"} per candidate
    completion), each a mean over the completion's tokens (0.0 for an empty completion)."""
    pad_id = policy.tokenizer.pad_token_id
    if pad_id is None:
        pad_id = policy.tokenizer.eos_token_id
    model = policy.model
    baseline_values, candidate_values = [], []
    for start in range(0, len(baseline), DRIFT_BATCH):
        with sampling_weights(policy, baseline=True):
            rows = _log_softmax_rows(model, baseline[start:start + DRIFT_BATCH], pad_id,
                                     temperature)
        baseline_values += [{"entropy": _mean(_entropy(r))} for r in rows]
    for start in range(0, len(candidate), DRIFT_BATCH):
        batch = candidate[start:start + DRIFT_BATCH]
        with sampling_weights(policy):
            mine = _log_softmax_rows(model, batch, pad_id, temperature)
        with sampling_weights(policy, baseline=True):
            reference = _log_softmax_rows(model, batch, pad_id, temperature)
        for own, base in zip(mine, reference):
            kl = (own.exp() * (own - base)).sum(-1)
            candidate_values.append({"entropy": _mean(_entropy(own)), "kl_to_baseline": _mean(kl)})
    return baseline_values, candidate_values


def _mean(values: torch.Tensor) -> float:
    return float(values.double().mean()) if values.numel() else 0.0
