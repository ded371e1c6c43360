"""Rollout: sample G completions per prompt from one fixed policy version.

`generate_completions` is a pure function of (model, tokenizer, prompts, settings, seed): it
returns plain `Completion` records holding token ids and text, nothing else. Scoring happens in
`score_completions` (timed separately as verification), and `trajectory_records` joins both into
the records written to trajectories.jsonl. All prompts of a step are batched across groups.
"""

from __future__ import annotations

import hashlib
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


def _left_pad(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, width - len(sequence):] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, width - len(sequence):] = 1
    return input_ids.to(device), attention_mask.to(device)


@torch.no_grad()
def generate_completions(model, tokenizer, prompt_token_ids: list[list[int]], group_size: int,
                         settings: SamplingSettings, seed: int, progress=None) -> list[Completion]:
    """Sample `group_size` completions for every prompt, batched across groups.

    The torch RNG is seeded once here, so the same (policy, prompts, seed) gives the same
    completions: the baseline and the candidate see the same seeds in the re-test.
    """
    eos_ids = _eos_ids(model, tokenizer)
    jobs = [(p, g) for p in range(len(prompt_token_ids)) for g in range(group_size)]
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    completions: list[Completion] = []
    was_training = model.training
    model.eval()
    for start in range(0, len(jobs), settings.batch_size):
        chunk = jobs[start:start + settings.batch_size]
        input_ids, attention_mask = _left_pad([prompt_token_ids[p] for p, _ in chunk],
                                              tokenizer.pad_token_id, device)
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
            temperature=settings.temperature, top_p=settings.top_p, top_k=0,
            max_new_tokens=settings.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=sorted(eos_ids))
        generated = output[:, input_ids.shape[1]:].tolist()
        for (prompt_index, sample_index), tokens in zip(chunk, generated):
            completion, stopped = _cut_at_eos(tokens, eos_ids)
            completions.append(Completion(
                prompt_index, sample_index, prompt_token_ids[prompt_index], completion,
                tokenizer.decode(completion, skip_special_tokens=True), not stopped))
        if progress is not None:
            progress(len(chunk))
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
