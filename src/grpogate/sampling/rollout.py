"""Rollout: sample G completions per prompt from one fixed policy version.

`generate_completions` is a pure function of (model, tokenizer, prompts, settings, seed): it
returns plain `Completion` records holding token ids and text, nothing else. Scoring happens in
`score_completions` (the correctness verifier) and `score_rewards` (every weighted component; both
timed as verification), and `trajectory_records` joins them into the records written to
trajectories.jsonl. All prompts of a step are batched across groups.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from grpogate.engines import engine_for, row_kernels
from grpogate.engines.rows import ROW_BUCKET, round_up
from grpogate.config import RunConfig
from grpogate.errors import InputError
from grpogate.seeding import prompt_seed
from grpogate.inputs.tasks import Problem


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float
    top_p: float
    batch_size: int
    top_k: int = RunConfig.top_k  # 0: off (the schema's default)
    min_p: float = RunConfig.min_p  # 0: off

    @property
    def truncates(self) -> bool:
        """Whether the sampled distribution is a truncation of softmax(logits / temperature)."""
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


def sampling_settings(config: RunConfig) -> SamplingSettings:
    """The same settings for training rollouts, the re-test and `grpogate eval`."""
    return SamplingSettings(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                            top_p=config.top_p, batch_size=config.generation_batch_size,
                            top_k=config.top_k, min_p=config.min_p)


@dataclass
class Completion:
    prompt_index: int  # index into the problem list
    sample_index: int  # 0..G-1 within the group
    prompt_token_ids: list[int]
    completion_token_ids: list[int]  # up to and including EOS when the model stopped
    text: str
    hit_max_length: bool  # no EOS within the token budget: the answer may be cut off
    # The log-prob of each drawn token under the distribution it was drawn from: truncated
    # (top_k / top_p / min_p) and renormalized when the settings truncate, else the full one.
    sampler_logprobs: list[float] = field(default_factory=list)
    # What a measuring stepper (drift.DriftStepper) measured on this completion's positions.
    measured: dict = field(default_factory=dict)


def encode_prompts(tokenizer, problems: list[Problem], system_prompt: str,
                   max_prompt_tokens: int) -> list[list[int]]:
    """Chat-template every question; a prompt over budget is an input error, never truncated.

    A question is first held to a byte bound, before the tokenizer sees it: a prompt of
    max_prompt_tokens tokens spans at most max_prompt_tokens x (the vocabulary's longest token
    in UTF-8 bytes), so a longer question cannot fit, and tokenizing it whole (a 50 MB line:
    minutes and gigabytes) would only confirm that."""
    encoded, byte_bound = [], None
    for problem in problems:
        size = len(problem.question.encode("utf-8"))
        if size > max_prompt_tokens:  # only then can it be over the bound (a token >= 1 byte)
            byte_bound = byte_bound or max_prompt_tokens * longest_token_bytes(tokenizer)
            if size > byte_bound:
                raise InputError(
                    f"{problem.source}: prompt {problem.prompt_id} is {size} bytes, over the "
                    f"{byte_bound} bytes that max_prompt_tokens={max_prompt_tokens} tokens can "
                    f"hold (x {byte_bound // max_prompt_tokens} bytes, this vocabulary's longest "
                    "token); drop the problem")
        # No system prompt (a dataset task's own prompt): the user message alone, as TRL renders it.
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
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


def longest_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes one token of `tokenizer` stands for: its longest
    vocabulary entry as stored (a byte-level entry's characters are at least as many bytes as
    the bytes they map; "<0xE3>" is longer than its one byte), and never under 4 (one
    character)."""
    return max(4, max(len(token.encode("utf-8")) for token in tokenizer.get_vocab()))


SAMPLE_BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


def _sample(logits: torch.Tensor, temperature: float, top_p: float, generator,
            block: int = SAMPLE_BLOCK, top_k: int = RunConfig.top_k,
            min_p: float = RunConfig.min_p,
            with_logprobs: bool = False):
    """logits [N, V] -> token ids [N] sampled at `temperature` from the distribution truncated
    as transformers orders it: the `top_k` most likely tokens, then the `top_p` nucleus of those,
    then the tokens with at least `min_p` x the top token's probability. With `with_logprobs`,
    also [N] float32: each drawn token's log-prob under that truncated, renormalized
    distribution (the full one when nothing truncates).

    Inverse-CDF sampling with one uniform number per row, in two levels: pick a block of `block`
    tokens by the cumulative block masses, then a token inside it. torch.multinomial draws an
    exponential for every vocabulary entry (49,152 per row here) and a full float64 cumulative
    sum costs as much again, each a large share of decoding time (docs/measurements.md,
    "Figures moved from code comments"); the two levels need neither.
    The log-prob costs one gather and the kept mass this function sums anyway. With nothing
    truncated, the native kernels (where they build) run the same two levels row by row on the
    logits as they are (`engines.row_kernels`): no float32 copy of the batch, which is much of
    the torch draw's cost (docs/measurements.md, "Figures moved from code comments").
    `generator` is a torch.Generator (one uniform per row drawn from it) or the uniforms
    themselves, [N, 1] float64 in [0, 1) (`_decode_groups` draws them per prompt).
    """
    if top_p >= 1.0 and top_k <= 0 and min_p <= 0.0:  # the whole distribution
        kernels = row_kernels(logits.dtype, logits.device)
        if kernels is not None:  # the same draw row by row, without a float32 copy
            tokens, logprobs = kernels.sample_rows(
                logits.contiguous(), temperature, block,
                _uniforms(generator, len(logits), logits.device).reshape(-1).contiguous())
            return (tokens, logprobs) if with_logprobs else tokens
    # Unnormalized probabilities exp((x - max) / T), built in place in one float32 copy: the
    # inverse CDF scales its draw by the total mass, so no normalization pass is needed. The
    # top token's entry is exactly 1, so min_p compares against min_p itself.
    scores = logits.to(torch.float32, copy=True)  # never the caller's tensor, even in float32
    top = scores.amax(dim=-1, keepdim=True)  # [N, 1]
    probs = scores.sub_(top).mul_(1.0 / temperature).exp_()  # [N, V]
    order = None
    if top_p < 1.0 or top_k > 0:
        probs, order = probs.sort(dim=-1, descending=True)
        if top_k > 0:
            probs[:, top_k:] = 0.0
        if top_p < 1.0:
            normalized = probs / probs.sum(dim=-1, keepdim=True)
            outside = normalized.cumsum(-1) - normalized > top_p  # keep the token that crosses
            probs = probs.masked_fill(outside, 0.0)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p, 0.0)
    chosen, kept_mass = _inverse_cdf(probs, generator, block)  # [N, 1] (sorted order), [N, 1]
    tokens = (order.gather(-1, chosen) if order is not None else chosen)  # [N, 1]
    if not with_logprobs:
        return tokens.squeeze(-1)
    # log p = (x - max) / T - log(kept mass), in log space so that no exp underflows.
    scaled = (logits.gather(-1, tokens).float() - top) / temperature  # [N, 1]
    return tokens.squeeze(-1), (scaled - kept_mass.log().float()).squeeze(-1)


def _inverse_cdf(probs: torch.Tensor, generator, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [N, V] non-negative, unnormalized -> (chosen index [N, 1], total mass [N, 1]).
    `generator`: a torch.Generator, or the rows' uniforms [N, 1] float64."""
    rows, vocab = probs.shape
    whole = vocab // block * block
    masses = [probs[:, :whole].reshape(rows, -1, block).sum(-1)]  # float32 block sums [N, V / block]
    if whole < vocab:
        masses.append(probs[:, whole:].sum(-1, keepdim=True))
    mass = torch.cat(masses, dim=1).double()  # [N, blocks]
    cdf = mass.cumsum(dim=1)
    draw = _uniforms(generator, rows, probs.device) * cdf[:, -1:]
    # searchsorted(right=True) never lands on a zero-mass step; rounding past the end is
    # pulled back to the last block (or token) that has mass.
    chosen_block = torch.minimum(torch.searchsorted(cdf, draw, right=True), _last_positive(mass))
    below = torch.where(chosen_block > 0, cdf.gather(1, (chosen_block - 1).clamp(min=0)), 0.0)
    index = chosen_block * block + torch.arange(block, device=probs.device)  # [N, block]
    inside = probs.gather(1, index.clamp(max=vocab - 1)).double() * (index < vocab)
    within = torch.searchsorted(inside.cumsum(dim=1), draw - below, right=True)
    return index.gather(1, torch.minimum(within, _last_positive(inside))), cdf[:, -1:]


def _uniforms(generator, rows: int, device) -> torch.Tensor:
    """[rows, 1] float64 on `device`: the given uniforms, or one drawn per row from the
    torch.Generator `generator`."""
    uniform = (generator if isinstance(generator, torch.Tensor) else
               torch.rand((rows, 1), generator=generator, device=device, dtype=torch.float64))
    return uniform.to(device=device, dtype=torch.float64)


def _last_positive(values: torch.Tensor) -> torch.Tensor:
    """[N, K] non-negative -> [N, 1] index of each row's last positive entry."""
    positions = torch.arange(values.shape[1], device=values.device)
    return torch.where(values > 0, positions, 0).amax(dim=1, keepdim=True)


def _row_uniforms(generators: list, rows: torch.Tensor, group_size: int) -> torch.Tensor:
    """[len(rows), 1] float64: row r's uniform for this decode step.

    Every prompt with a row still in the batch draws G uniforms from its own generator, and
    row (prompt p, sample i) takes p's i-th: the draws of a prompt never depend on which other
    prompts share its batch or how many of its rows are still running, so a prompt samples the
    same tokens alone, in a larger batch or on another rank (world-size invariance)."""
    prompt_of_row = (rows // group_size).tolist()
    table = torch.zeros((len(generators), group_size), dtype=torch.float64)  # [P, G]
    for prompt in sorted(set(prompt_of_row)):
        table[prompt] = torch.rand(group_size, generator=generators[prompt], dtype=torch.float64)
    return table.view(-1)[rows.cpu()].unsqueeze(1).to(rows.device)


# Inference mode: no autograd bookkeeping per op, the same tokens (docs/measurements.md,
# "Figures moved from code comments").
@torch.inference_mode()
def _decode_groups(stepper, prompts: list[list[int]], group_size: int, settings: SamplingSettings,
                   eos_ids: set[int], pad_id: int, generator, device,
                   advance=None, shared: int | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Sample `group_size` continuations of each prompt; returns token lists and each token's
    sampler log-prob, prompt-major.

    Each prompt is prefilled once and its KV cache repeated G times; a row that emits EOS leaves
    the batch (its cache rows are dropped), so finished sequences cost no further decode steps.
    `generator` is one CPU torch.Generator per prompt (`_row_uniforms`), or a single one that
    all prompts draw from in turn. `advance(n)` is told of rows as they finish (the progress
    bar moves during the batch, not only at its end); all rows are reported by the time this
    returns.
    """
    advance = advance or (lambda count: None)
    generators = generator if isinstance(generator, list) else [generator] * len(prompts)
    total, reported = len(prompts) * group_size, 0
    # A batch under ROW_BUCKET rows rides with copies of its last prompt (never live, their own
    # generator): below 8 rows the CPU matmul takes another kernel whose sums round
    # differently (docs/measurements.md, "Figures moved from code comments"), so a prompt
    # alone on a rank would not reproduce the log-probs it gets in one process's larger batch.
    fillers = -(-max(ROW_BUCKET - total, 0) // group_size)
    prompts = prompts + [prompts[-1]] * fillers
    generators = generators + [torch.Generator().manual_seed(0)] * fillers
    logits = stepper.prefill(prompts, pad_id, group_size, settings.max_new_tokens, shared)
    rows = torch.arange(logits.shape[0], device=device)  # original row of each batch row
    live = rows < total  # not yet past EOS (a filler row never is)
    tokens: list[list[int]] = [[] for _ in range(logits.shape[0])]
    logprobs: list[list[float]] = [[] for _ in range(logits.shape[0])]
    eos = torch.tensor(sorted(eos_ids), device=device)
    for step in range(settings.max_new_tokens):
        uniforms = _row_uniforms(generators, rows, group_size)  # [rows, 1]
        chosen, chosen_logp = _sample(logits, settings.temperature, settings.top_p, uniforms,
                                      top_k=settings.top_k, min_p=settings.min_p,
                                      with_logprobs=True)  # [rows], [rows]
        for row, token, logp, alive in zip(rows.tolist(), chosen.tolist(), chosen_logp.tolist(),
                                           live.tolist()):
            if alive:
                tokens[row].append(token)
                logprobs[row].append(logp)
        live = live & ~torch.isin(chosen, eos)
        # Every still-live row is in the batch, so the rows finished so far are the rest.
        alive_count = int(live.sum())
        finished = total - alive_count
        if finished > reported:
            advance(finished - reported)
            reported = finished
        if step == settings.max_new_tokens - 1 or reported == total:
            break
        # Drop finished rows, keeping the row count a multiple of ROW_BUCKET (a few finished
        # rows ride along, their samples ignored) so the decode matmuls keep known shapes.
        target = min(len(live), round_up(alive_count, ROW_BUCKET))
        if target < len(live):
            keep = torch.cat([torch.nonzero(live).flatten(), torch.nonzero(~live).flatten()])[:target]
            keep = keep.sort().values
            stepper.select(keep)
            rows, chosen, live = rows[keep], chosen[keep], live[keep]
        logits = stepper.step(chosen)
    if reported < total:  # rows cut off by the token budget
        advance(total - reported)
    return tokens[:total], logprobs[:total]


def generate_completions(model, tokenizer, prompt_token_ids: list[list[int]], group_size: int,
                         settings: SamplingSettings, seed: int, advance=None,
                         stepper=None, prompt_indexes: list[int] | None = None,
                         shared_prefix: int | None = None) -> list[Completion]:
    """Sample `group_size` completions for every prompt, batched across groups.

    Each prompt has its own generator, seeded with `prompt_seed(seed, its index)` —
    `prompt_indexes[j]` (its index in the problem set; default j) — so the same (policy,
    prompt, seed, index) gives the same completions whatever batch or rank the prompt lands in,
    and the baseline and the candidate see the same seeds in the re-test. The model is used as
    it is: callers choose the weights (see `policy.sampling_weights`). `stepper` is the decode
    forward (default: its engine's, `engine_for(model).stepper(model)`, built from the weights as
    they are now); one with a
    `measured(row, tokens)` method fills each completion's `measured`.
    `shared_prefix`: the prefix the decoder computes once per batch, fixed over the caller's
    whole prompt set (`engines.rows.shared_prefix_length`) so batching never changes numerics.
    """
    eos_ids = _eos_ids(model, tokenizer)
    device = next(model.parameters()).device
    indexes = list(range(len(prompt_token_ids))) if prompt_indexes is None else prompt_indexes
    generators = [torch.Generator().manual_seed(prompt_seed(seed, index)) for index in indexes]
    stepper = stepper or engine_for(model).stepper(model)
    measured = getattr(stepper, "measured", None)  # a stepper that measures as it samples
    prompts_per_batch = max(1, settings.batch_size // group_size)
    completions: list[Completion] = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(prompt_token_ids), prompts_per_batch):
            chunk = list(range(start, min(start + prompts_per_batch, len(prompt_token_ids))))
            sampled, logprobs = _decode_groups(
                stepper, [prompt_token_ids[p] for p in chunk], group_size, settings, eos_ids,
                tokenizer.pad_token_id, [generators[p] for p in chunk], device, advance,
                shared_prefix)
            for offset, (tokens, token_logprobs) in enumerate(zip(sampled, logprobs)):
                prompt_index, sample_index = chunk[offset // group_size], offset % group_size
                completion, stopped = _cut_at_eos(tokens, eos_ids)
                completions.append(Completion(
                    prompt_index=prompt_index, sample_index=sample_index,
                    prompt_token_ids=prompt_token_ids[prompt_index],
                    completion_token_ids=completion,
                    text=tokenizer.decode(completion, skip_special_tokens=True),
                    hit_max_length=not stopped, sampler_logprobs=token_logprobs[:len(completion)],
                    measured=measured(offset, len(completion)) if measured else {}))
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
    """The correctness verifier's reward of every completion."""
    return [verifier.score(c.text, problems[c.prompt_index].reference) for c in completions]


def score_rewards(completions: list[Completion], problems: list[Problem], reward_set,
                  correctness: list[float]) -> list[dict[str, float]]:
    """Every reward component of every completion (`correctness` from `score_completions`)."""
    return [reward_set.score(c.text, problems[c.prompt_index].reference,
                             len(c.completion_token_ids), reward,
                             question=problems[c.prompt_index].question,
                             columns=problems[c.prompt_index].columns)
            for c, reward in zip(completions, correctness)]


def trace_id(run_id: str, step: int, prompt_id: str, sample_index: int) -> str:
    return hashlib.sha256(f"{run_id}|{step}|{prompt_id}|{sample_index}".encode()).hexdigest()[:24]


def trajectory_records(completions: list[Completion], components: list[dict[str, float]],
                       problems: list[Problem], *, run_id: str, step: int, policy_version: str,
                       verifier_version: str, reward_set, generation_round: int = 0) -> list[dict]:
    """One JSON-ready record per completion, with every identity the contract checks: each
    reward component and its version, and `reward`, their weighted total (what the
    advantages are computed from). `round` is the step's generation round (dynamic sampling)."""
    records = []
    for completion, values in zip(completions, components):
        problem = problems[completion.prompt_index]
        records.append({
            "step": step,
            "round": generation_round,
            "prompt_id": problem.prompt_id,
            "sample_index": completion.sample_index,
            "trace_id": trace_id(run_id, step, problem.prompt_id, completion.sample_index),
            "source_policy_version": policy_version,
            "verifier_version": verifier_version,
            "reward_versions": dict(reward_set.versions),
            "completion": completion.text,
            "completion_tokens": len(completion.completion_token_ids),
            "hit_max_length": completion.hit_max_length,
            "rewards": {name: float(value) for name, value in values.items()},
            "reward": reward_set.total(values),
            "sampler_logprobs": completion.sampler_logprobs,
        })
    return records
