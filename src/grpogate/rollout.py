"""Rollout: sample G completions per prompt from one fixed policy version.

`generate_completions` is a pure function of (model, tokenizer, prompts, settings, seed): it
returns plain `Completion` records holding token ids and text, nothing else. Scoring happens in
`score_completions` (timed separately as verification), and `trajectory_records` joins both into
the records written to trajectories.jsonl. All prompts of a step are batched across groups.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass

import torch

from grpogate.errors import InputError
from grpogate.tasks import Problem


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float
    top_p: float
    batch_size: int


@dataclass
class Completion:
    prompt_index: int  # index into the problem list
    sample_index: int  # 0..G-1 within the group
    prompt_token_ids: list[int]
    completion_token_ids: list[int]  # up to and including EOS when the model stopped
    text: str
    hit_max_length: bool  # no EOS within the token budget: the answer may be cut off


def encode_prompts(tokenizer, problems: list[Problem], system_prompt: str,
                   max_prompt_tokens: int) -> list[list[int]]:
    """Chat-template every question; a prompt over budget is an input error, never truncated."""
    encoded = []
    for problem in problems:
        messages = [{"role": "system", "content": system_prompt},
                    {"role": "user", "content": problem.question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = list(ids)
        if len(ids) > max_prompt_tokens:
            raise InputError(
                f"{problem.source}: prompt {problem.prompt_id} has {len(ids)} tokens, over "
                f"max_prompt_tokens={max_prompt_tokens}; raise max_prompt_tokens or drop the problem")
        encoded.append(ids)
    return encoded


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


def _sample(logits: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
    """logits [N, V] -> token ids [N], sampled at `temperature` within the top-p nucleus.

    Inverse-CDF sampling: one uniform number per row and a search in the cumulative
    distribution. torch.multinomial draws an exponential for every vocabulary entry (49,152
    per row here) on one thread; measured, that was 29 % of all decoding time.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    order = None
    if top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
        outside = probs.cumsum(-1) - probs > top_p  # keep the token that crosses top_p
        probs = probs.masked_fill(outside, 0.0)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [N, V]; float64 keeps the tail exact
    draw = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device,
                      dtype=torch.float64) * cdf[:, -1:]
    chosen = torch.searchsorted(cdf, draw, right=True).clamp_(max=probs.shape[-1] - 1)  # [N, 1]
    # A zero-probability token is never chosen: searchsorted(right=True) skips flat steps.
    return (order.gather(-1, chosen) if order is not None else chosen).squeeze(-1)


@torch.no_grad()
def _decode_groups(model, prompts: list[list[int]], group_size: int, settings: SamplingSettings,
                   eos_ids: set[int], pad_id: int, generator, keyword: str) -> list[list[int]]:
    """Sample `group_size` continuations of each prompt; returns token lists, prompt-major.

    Each prompt is prefilled once and its KV cache repeated G times; a row that emits EOS leaves
    the batch (its cache rows are dropped), so finished sequences cost no further decode steps.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad(prompts, pad_id, device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    output = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=True, logits_to_keep=1, **{keyword: cache})
    cache.batch_repeat_interleave(group_size)
    logits = output.logits[:, -1].repeat_interleave(group_size, dim=0)  # [N, V]
    attention_mask = attention_mask.repeat_interleave(group_size, dim=0)  # [N, P]
    positions = position_ids[:, -1].repeat_interleave(group_size, dim=0)  # [N]
    rows = torch.arange(logits.shape[0], device=device)  # original row of each batch row
    live = torch.ones(len(rows), dtype=torch.bool, device=device)  # not yet past EOS
    tokens: list[list[int]] = [[] for _ in range(logits.shape[0])]
    eos = torch.tensor(sorted(eos_ids), device=device)
    for step in range(settings.max_new_tokens):
        chosen = _sample(logits, settings.temperature, settings.top_p, generator)  # [rows]
        for row, token, alive in zip(rows.tolist(), chosen.tolist(), live.tolist()):
            if alive:
                tokens[row].append(token)
        live = live & ~torch.isin(chosen, eos)
        if step == settings.max_new_tokens - 1 or not live.any():
            break
        # Drop finished rows, keeping the row count a multiple of ROW_BUCKET (a few finished
        # rows ride along, their samples ignored) so the decode matmuls keep known shapes.
        target = min(len(live), round_up(int(live.sum()), ROW_BUCKET))
        if target < len(live):
            keep = torch.cat([torch.nonzero(live).flatten(), torch.nonzero(~live).flatten()])[:target]
            keep = keep.sort().values
            cache.batch_select_indices(keep)
            rows, chosen, live = rows[keep], chosen[keep], live[keep]
            attention_mask, positions = attention_mask[keep], positions[keep]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
        positions = positions + 1
        output = model(input_ids=chosen[:, None], attention_mask=attention_mask,
                       position_ids=positions[:, None], use_cache=True, logits_to_keep=1,
                       **{keyword: cache})
        logits = output.logits[:, -1]
    return tokens


def generate_completions(model, tokenizer, prompt_token_ids: list[list[int]], group_size: int,
                         settings: SamplingSettings, seed: int, progress=None) -> list[Completion]:
    """Sample `group_size` completions for every prompt, batched across groups.

    A private generator seeded here makes the same (policy, prompts, seed) give the same
    completions: the baseline and the candidate see the same seeds in the re-test. The model is
    used as it is: callers choose the weights (see `policy.sampling_weights`).
    """
    eos_ids = _eos_ids(model, tokenizer)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    keyword = cache_keyword(model)
    prompts_per_batch = max(1, settings.batch_size // group_size)
    completions: list[Completion] = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(prompt_token_ids), prompts_per_batch):
            chunk = list(range(start, min(start + prompts_per_batch, len(prompt_token_ids))))
            sampled = _decode_groups(model, [prompt_token_ids[p] for p in chunk], group_size,
                                     settings, eos_ids, tokenizer.pad_token_id, generator,
                                     keyword)
            for offset, tokens in enumerate(sampled):
                prompt_index, sample_index = chunk[offset // group_size], offset % group_size
                completion, stopped = _cut_at_eos(tokens, eos_ids)
                completions.append(Completion(
                    prompt_index, sample_index, prompt_token_ids[prompt_index], completion,
                    tokenizer.decode(completion, skip_special_tokens=True), not stopped))
            if progress is not None:
                progress(len(sampled))
    finally:
        model.train(was_training)
    return completions


def _eos_ids(model, tokenizer) -> set[int]:
    configured = model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, list) else [configured])
    ids.add(tokenizer.eos_token_id)
    return {i for i in ids if i is not None}


def _cut_at_eos(tokens: list[int], eos_ids: set[int]) -> tuple[list[int], bool]:
    for position, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:position + 1], True  # keep EOS: stopping is the policy's choice too
    return tokens, False


def score_completions(completions: list[Completion], problems: list[Problem], verifier) -> list[float]:
    return [verifier.score(c.text, problems[c.prompt_index].reference) for c in completions]


def trace_id(run_id: str, step: int, prompt_id: str, sample_index: int) -> str:
    return hashlib.sha256(f"{run_id}|{step}|{prompt_id}|{sample_index}".encode()).hexdigest()[:24]


def trajectory_records(completions: list[Completion], rewards: list[float], problems: list[Problem],
                       *, run_id: str, step: int, policy_version: str,
                       verifier_version: str) -> list[dict]:
    """One JSON-ready record per completion, with every identity the contract checks."""
    records = []
    for completion, reward in zip(completions, rewards):
        problem = problems[completion.prompt_index]
        records.append({
            "step": step,
            "prompt_id": problem.prompt_id,
            "sample_index": completion.sample_index,
            "trace_id": trace_id(run_id, step, problem.prompt_id, completion.sample_index),
            "source_policy_version": policy_version,
            "verifier_version": verifier_version,
            "completion": completion.text,
            "completion_tokens": len(completion.completion_token_ids),
            "hit_max_length": completion.hit_max_length,
            "reward": float(reward),
        })
    return records


def contract_groups(records: list[dict]) -> list[dict]:
    """Group trajectory records per prompt into the shape `check_rollout_contract` reads."""
    groups: dict[str, dict] = {}
    for record in records:
        group = groups.setdefault(record["prompt_id"], {
            "prompt_id": record["prompt_id"],
            "source_policy_version": record["source_policy_version"],
            "verifier_version": record["verifier_version"],
            "trace_ids": []})
        # A group mixing versions must fail the contract, not be silently relabelled.
        if record["source_policy_version"] != group["source_policy_version"]:
            group["source_policy_version"] = "mixed"
        if record["verifier_version"] != group["verifier_version"]:
            group["verifier_version"] = "mixed"
        group["trace_ids"].append(record["trace_id"])
    return list(groups.values())
