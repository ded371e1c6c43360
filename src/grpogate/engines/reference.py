"""The reference engine: the model's own transformers (and PEFT) forward, unpatched.

It runs any causal language model transformers loads, and it is the engine the contract
suite (tests/test_engine_contract.py) holds the CPU accelerator to. Decoding calls the model's
forward with a transformers KV cache (`ModelStepper`); scoring forwards each prompt's
completions teacher-forced, the prefix they share once (`teacher_forced_logits`); the update
runs the model's forward as it is.
"""

from __future__ import annotations

import contextlib

import torch

from grpogate.engines.rows import (WIDTH_BUCKET, cache_keyword, left_pad, round_up,
                                   shared_prefix_length)


class ModelStepper:
    """The model's own forward with a transformers DynamicCache: the path for any architecture.

    The `Stepper` interface (engines/__init__.py): prefill -> logits [N, V], step(tokens) -> logits,
    select(rows). The prompt is prefilled once and its KV cache repeated G times.
    """

    name = "model-forward"  # recorded in the evidence: which forward produced the samples

    holds_weights = False  # it reads the model's weights as they are at each call

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


def teacher_forced_logits(model, sequences: list[tuple[list[int], list[int]]],
                          pad_id: int) -> list[torch.Tensor]:
    """(prompt tokens, completion tokens) pairs -> one [tokens_i, V] tensor of next-token logits
    per completion, at the positions that predict its tokens. The prefix every sequence shares
    (system prompt, chat template: most of a prompt) is forwarded once and its KV cache
    repeated for the batch; each sequence's rest (prompt suffix + completion) follows,
    right-padded."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    shared = shared_prefix_length([prompt for prompt, _ in sequences])
    rests = [prompt[shared:] + completion for prompt, completion in sequences]
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
        prefix = torch.tensor([sequences[0][0][:shared]], device=device)
        model(input_ids=prefix, use_cache=True, logits_to_keep=1, **extra)
        extra[cache_keyword(model)].batch_repeat_interleave(len(rests))
    positions = shared + torch.arange(width, device=device)[None].expand(len(rests), -1)
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                   position_ids=positions, use_cache=bool(shared), **extra).logits
    rows = []
    for row, (prompt, completion) in enumerate(sequences):
        # Completion token j sits at rest column len(suffix) + j, predicted one column before.
        first = len(prompt) - shared - 1
        rows.append(logits[row, first:first + len(completion)])
    return rows


class ModelScorer:
    """Teacher-forced logits from the model's forward on its weights as they are when called
    (`holds_weights` False: the caller puts the policy's weights in place around each call),
    one prompt's completions per forward."""

    holds_weights = False

    def __init__(self, model):
        self.model = model

    def __call__(self, groups: list[tuple[list[int], list[list[int]]]],
                 pad_id: int) -> list[list[torch.Tensor]]:
        return [teacher_forced_logits(self.model, [(prompt, c) for c in completions], pad_id)
                for prompt, completions in groups]


class ReferenceEngine:
    """The `Engine` for any architecture: the model's own forward everywhere."""

    name = "reference"

    def __init__(self, declined: str = ""):
        self.declined = declined  # why the CPU accelerator declined the model ("" if not asked)

    def stepper(self, model) -> ModelStepper:
        return ModelStepper(model)

    def scorer(self, model, prefix: list[int]) -> ModelScorer:
        return ModelScorer(model)

    def update_forward(self, model):
        return contextlib.nullcontext()

    def packed_attention(self, model, segments):
        return contextlib.nullcontext()

    def identity(self) -> dict:
        return {"name": self.name, "declined": self.declined}
