"""The obvious way to completion log-probs: every sequence forwarded whole.

Test-only: the update uses `training.logprobs.shared_prompt_logprobs` (one prompt forward per
group); the tests hold the two equal, values and gradients, and this against a full log-softmax.
"""

from __future__ import annotations

import torch

from grpogate.engines.rows import left_pad
from grpogate.training.logprobs import token_logprobs, right_pad


def pack_sequences(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device):
    """Left-pad prompts and right-pad completions so completions start at the same column.

    Returns input_ids/attention_mask [N, P+T], completion ids [N, T], completion mask [N, T].
    """
    prompt_ids, prompt_mask = left_pad(prompts, pad_id, device)
    completion_ids, completion_mask = right_pad(completions, pad_id, device)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask.long()], dim=1)
    return input_ids, attention_mask, completion_ids, completion_mask


def completion_logprobs(model, input_ids, attention_mask, completion_ids, temperature: float,
                        chunk: int = 64) -> torch.Tensor:
    """Log-probs [N, T] of the completion tokens, one full forward per sequence.

    Only the completion positions' logits are produced (`logits_to_keep`).
    """
    width = completion_ids.shape[1]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # as generation computes them
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=width + 1, use_cache=False).logits[:, :-1]  # [N, T, V]
    return token_logprobs(logits, completion_ids, temperature, chunk)
