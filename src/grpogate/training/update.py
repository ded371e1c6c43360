"""Update: the optimizer steps of one rollout's valid groups, all or nothing.

This module moves data and steps the optimizer: it forwards each micro-batch, hands the
tensors to `objectives.micro_batch_loss` (the whole loss: terms, mask, aggregation,
denominator), back-propagates, and steps. The maths lives there.
Where this departs from the DeepSeekMath GRPO objective (Shao et al. 2024, eq. 3), and why:
- Only valid groups (rewards not all equal) are forwarded (`advantages.build_update_batch`):
  the others have zero advantage, so zero gradient; their KL term is dropped with them.
- The KL term is estimated (k1 / k2 / k3, `kl_estimator`) against the baseline policy (adapter
  disabled, or the frozen baseline adapter) — not a second model copy; beta = 0 runs no
  reference forward at all.
- Each group's prompt is forwarded once and its KV cache shared by its completions
  (`logprobs.shared_prompt_logprobs`), or the micro-batch is packed into one padding-free row
  with the prompts' common prefix once (`logprobs.packed_logprobs`), whichever
  `batching.forward_cost` estimates cheaper; both equal one forward per sequence (tested). A
  micro-batch smaller than a group carries a slice of one, its prompt forwarded per slice.
- pi_old is the trainer's own forward of the rollout policy. With one optimizer step per
  rollout (num_iterations 1, one step of groups) that *is* the current policy, so its
  log-probs are the detached current ones (ratio 1) and no extra forward is spent; otherwise
  they are computed once before the first step. The sampler's log-probs (another numerical
  path: merged weights, the lean decoder) are compared with pi_old on the first pass (the
  mismatch metrics) and, with `rollout_correction`, reweight the surrogate by the truncated
  pi_old / pi_sampler.
  When the sampler truncates its distribution (top_k / top_p / min_p), pi_old is instead the
  sampler's own log-prob under that truncated, renormalized distribution, so the ratio is taken
  against what was really sampled from.
- With `mask_truncated_completions`, completions that hit max_new_tokens add no loss and do not
  count in the loss denominator (sequences or tokens); their advantages are computed with them.
- Any failure rolls the adapter and optimizer back to before the rollout's update; an
  out-of-memory error is retried once at half the micro-batch.
- Several processes (torchrun): every rank holds the whole step's batch; the one-process
  micro-batch plan is dealt round-robin over the ranks, each micro-batch divided by the
  denominator it has in one process (the whole step's tokens or sequences, or bnpo's
  micro-batch tokens x the step's micro-batch count), and the gradients are summed over ranks
  before clipping: the optimizer step is the one-process step up to float summation order. A
  NaN or out-of-memory on any rank is agreed on by all before any rolls back.
Shapes: N sequences per micro-batch, T completion tokens (right-padded), B groups of G.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch

from grpogate.config import RunConfig
from grpogate.distributed import SINGLE, World
from grpogate.training import data_parallel, objectives
from grpogate.training.advantages import UpdateBatch
from grpogate.training.batching import (ForwardShape, micro_batches, pack_rows, padded_rows,
                                        rows_per_prompt, step_plan)
from grpogate.training.logprobs import PackedGroups, PackedRow, micro_batch_logprobs
from grpogate.training.rollback import (TrainingSnapshot, first_line, is_out_of_memory,
                                       release_cached_memory)


class NonFiniteUpdate(RuntimeError):
    """A NaN/inf loss or gradient: the optimizer step was not taken."""


class UpdateFailed(RuntimeError):
    """The update ran out of memory again after the retry at half the micro-batch."""


DEFAULTS = RunConfig()  # the config schema holds every default; the settings below read it


@dataclass
class UpdateSettings:
    """The update's knobs (config/schema.py documents each and holds their defaults). A run
    builds them from its config (`from_config`); tests and the bench override a few."""

    max_grad_norm: float = DEFAULTS.max_grad_norm
    micro_batch_size: int = DEFAULTS.micro_batch_size
    groups_per_update: int = DEFAULTS.groups_per_update  # 0: all valid groups in one step
    temperature: float = DEFAULTS.temperature
    loss_type: str = DEFAULTS.loss_type
    importance_sampling_level: str = DEFAULTS.importance_sampling_level
    epsilon: float = DEFAULTS.epsilon
    epsilon_high: float = DEFAULTS.resolved_epsilon_high()  # resolved: never 0
    delta: float = DEFAULTS.delta
    beta: float = DEFAULTS.beta
    kl_estimator: str = DEFAULTS.kl_estimator
    num_iterations: int = DEFAULTS.num_iterations
    top_entropy_quantile: float = DEFAULTS.top_entropy_quantile
    rollout_correction: str = DEFAULTS.rollout_correction
    rollout_correction_cap: float = DEFAULTS.rollout_correction_cap
    max_new_tokens: int = DEFAULTS.max_new_tokens  # dr_grpo's constant normalizer
    # batching.LAYOUTS: not a config knob (both layouts give the same log-probs); the bench
    # and the tests force one to compare them.
    layout: str = "auto"

    @classmethod
    def from_config(cls, config: RunConfig) -> "UpdateSettings":
        names = [f.name for f in dataclasses.fields(cls) if f.name not in ("epsilon_high", "layout")]
        return cls(**{name: getattr(config, name) for name in names},
                   epsilon_high=config.resolved_epsilon_high())

    @property
    def loss(self) -> objectives.LossSettings:
        """The objective's share of these knobs."""
        return objectives.LossSettings(**{f.name: getattr(self, f.name)
                                          for f in dataclasses.fields(objectives.LossSettings)})


@dataclass
class UpdateRecord:
    update_count: int = 0  # optimizer steps that really happened
    sequences: int = 0  # sequence passes (a sequence counts once per iteration)
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    kl_sum: float = 0.0
    clipped_tokens: int = 0
    masked_sequences: int = 0  # forwarded for their group but adding no loss (truncated)
    trained_tokens: int = 0  # tokens with a non-zero surrogate weight (entropy mask, correction)
    # Positions the update's forwards computed (policy, reference, pi_old), padding included,
    # and the real ones among them: the padding's share is compute spent on nothing.
    forwarded_tokens: int = 0
    forwarded_real_tokens: int = 0
    # Per iteration (pass over the rollout): tokens and clipped tokens.
    pass_tokens: list[int] = field(default_factory=list)
    pass_clipped: list[int] = field(default_factory=list)
    pass_max_abs_log_ratio: list[float] = field(default_factory=list)  # max |log pi / pi_old|
    entropy_sum: float = 0.0  # over the first pass's tokens
    entropy_tokens: int = 0
    # Sampler vs trainer (pi_old), first pass: sum and max |delta log p|, sum of k3.
    mismatch_tokens: int = 0
    mismatch_abs_sum: float = 0.0
    mismatch_abs_max: float = 0.0
    mismatch_k3_sum: float = 0.0

    def add_micro_batch(self, sequences: int, metrics: objectives.LossMetrics) -> None:
        """Count one back-propagated micro-batch of the current pass."""
        self.sequences += sequences
        self.masked_sequences += metrics.masked_sequences
        self.tokens += metrics.tokens
        self.trained_tokens += metrics.trained_tokens
        self.kl_sum += metrics.kl_sum
        self.clipped_tokens += metrics.clipped_tokens
        self.pass_tokens[-1] += metrics.tokens
        self.pass_clipped[-1] += metrics.clipped_tokens
        self.pass_max_abs_log_ratio[-1] = max(self.pass_max_abs_log_ratio[-1],
                                              metrics.max_abs_log_ratio)

    def summary(self) -> dict:
        def mean(total: float, count: int):
            return total / count if count else None

        return {
            "update_count": self.update_count,
            "sequences": self.sequences,
            "masked_truncated_sequences": self.masked_sequences,
            "tokens": self.tokens,  # the loss's tokens over all passes (the audit recounts them)
            "tokens_forwarded": self.forwarded_tokens,
            "tokens_forwarded_real": self.forwarded_real_tokens,
            "loss": self.losses,
            "grad_norm": self.grad_norms,
            "mean_kl": self.kl_sum / self.tokens if self.tokens else 0.0,
            "clip_fraction": self.clipped_tokens / self.tokens if self.tokens else 0.0,
            "clip_fraction_by_iteration": [c / t if t else 0.0 for c, t in
                                           zip(self.pass_clipped, self.pass_tokens)],
            "max_abs_log_ratio_by_iteration": self.pass_max_abs_log_ratio,
            "trained_token_fraction": self.trained_tokens / self.tokens if self.tokens else 0.0,
            "entropy": mean(self.entropy_sum, self.entropy_tokens),
            "entropy_tokens": self.entropy_tokens,
            "mismatch_tokens": self.mismatch_tokens,
            "mismatch_mean_abs_logp": mean(self.mismatch_abs_sum, self.mismatch_tokens),
            "mismatch_max_abs_logp": self.mismatch_abs_max if self.mismatch_tokens else None,
            "mismatch_k3_kl": mean(self.mismatch_k3_sum, self.mismatch_tokens),
        }


# --- the optimizer steps -----------------------------------------------------------------------


@dataclass
class _Step:
    """What every micro-batch of one rollout's update shares."""

    model: torch.nn.Module
    batch: UpdateBatch
    settings: UpdateSettings
    pad_id: int
    reference_mode: object  # context manager factory: the model as the baseline policy
    device: torch.device
    old_logp: dict[int, torch.Tensor]  # rollout-policy log-probs by row; empty: detached current
    record: UpdateRecord = field(default_factory=UpdateRecord)  # the counts of forwarded tokens
    iteration: int = 0  # which pass over the rollout
    world: World = SINGLE  # which micro-batches this process runs (`_dealt`)

    @functools.cached_property
    def shape(self) -> ForwardShape:
        """The model's forward cost, which `pack` weighs layouts by: once per update."""
        return ForwardShape.of(self.model.config)

    def pack(self, micro: list[int]) -> PackedGroups | PackedRow:
        return pack_rows(self.batch, micro, self.pad_id, self.device, self.settings.layout,
                         self.shape)

    def logprobs(self, packed: PackedGroups | PackedRow, micro: list[int],
                 entropy: list | None = None):
        executed, real = packed.forwarded_tokens()
        self.record.forwarded_tokens += executed
        self.record.forwarded_real_tokens += real
        return micro_batch_logprobs(self.model, packed, rows_per_prompt(self.batch, micro),
                                    self.settings.temperature, entropy)


def _run_agreed(step: _Step, optimizer, work) -> None:
    """`work()` and the ranks' agreement on it: when any rank hit a NaN or ran out of memory,
    every rank zeroes its gradients and raises, so all roll back together. One process: the
    error propagates as it always did."""
    failure, first = data_parallel.run_agreed(step.world, work, _failure_kind)
    if first is None:
        return
    optimizer.zero_grad(set_to_none=True)
    if failure is not None:
        raise failure
    rank, kind, message = first
    if kind == "non_finite":
        raise NonFiniteUpdate(f"rank {rank}: {message}")
    raise RuntimeError(f"out of memory on rank {rank}: {message}")  # is_out_of_memory matches


def _failure_kind(error: BaseException) -> str | None:
    if isinstance(error, NonFiniteUpdate):
        return "non_finite"
    return "out_of_memory" if is_out_of_memory(error) else None


def rollout_logprobs(step: _Step, rows: list[int], optimizer) -> dict[int, torch.Tensor]:
    """The rollout policy's log-probs of `rows`, fixed before the first optimizer step; each
    rank computes its dealt micro-batches, then every rank has every row's."""
    old_logp = {}

    def work() -> None:
        with torch.no_grad():
            micros = micro_batches(step.batch, rows, step.settings.micro_batch_size)
            for micro in data_parallel.deal(step.world, micros):
                old_logp.update(zip(micro, step.logprobs(step.pack(micro), micro)))

    _run_agreed(step, optimizer, work)
    return data_parallel.gather_rows(step.world, old_logp)


def _old_logprobs(step: _Step, logp: torch.Tensor, micro: list[int]) -> torch.Tensor:
    if not step.old_logp:
        return logp.detach()
    # Rows were precomputed in micro-batches of other widths: copy each row's prefix (which
    # covers its completion) over the detached current log-probs, so padded positions have
    # ratio 1 and never produce inf * 0.
    return padded_rows(micro, step.old_logp, logp)


def _record_first_pass(terms: objectives.MicroBatchTerms, record: UpdateRecord) -> None:
    """Entropy and the sampler-trainer mismatch, once per row (the first pass)."""
    real = terms.mask.bool()
    if terms.entropy is not None:
        record.entropy_sum += float(terms.entropy[real].sum())
        record.entropy_tokens += int(real.sum())
    if terms.sampler_logp is not None:
        absolute, k3 = objectives.mismatch_terms(terms.old_logp, terms.sampler_logp)
        record.mismatch_tokens += int(real.sum())
        record.mismatch_abs_sum += float(absolute[real].sum())
        record.mismatch_abs_max = max(record.mismatch_abs_max,
                                      float(absolute[real].max()) if real.any() else 0.0)
        record.mismatch_k3_sum += float(k3[real].sum())


def _micro_batch_terms(step: _Step, micro: list[int]) -> objectives.MicroBatchTerms:
    """Forward the micro-batch (reference, then policy) and line up what the loss reads."""
    settings, batch = step.settings, step.batch
    packed = step.pack(micro)
    ref_logp = None
    if settings.beta > 0:
        with torch.no_grad(), step.reference_mode():
            ref_logp = step.logprobs(packed, micro)
    entropies = [] if step.iteration == 0 or settings.top_entropy_quantile < 1.0 else None
    logp = step.logprobs(packed, micro, entropies)
    old = _old_logprobs(step, logp, micro)
    return objectives.MicroBatchTerms(
        logp=logp, old_logp=old,
        advantages=torch.tensor([batch.advantages[i] for i in micro], device=step.device,
                                dtype=logp.dtype),
        completion_mask=packed.completion_mask,
        contributes=torch.tensor([batch.contributing(i) for i in micro], device=step.device,
                                 dtype=packed.completion_mask.dtype),
        ref_logp=ref_logp,
        sampler_logp=(padded_rows(micro, batch.sampler_logprobs, old)
                      if batch.sampler_logprobs else None),
        entropy=entropies[0] if entropies else None)


def _backward_micro_batch(step: _Step, micro: list[int], denominator: objectives.Denominator,
                          record: UpdateRecord) -> float:
    """Forward, loss (objectives.micro_batch_loss), backward for one micro-batch; returns its
    loss."""
    terms = _micro_batch_terms(step, micro)
    if step.iteration == 0:
        _record_first_pass(terms, record)
    loss, metrics = objectives.micro_batch_loss(terms, step.settings.loss, denominator)
    if not torch.isfinite(loss):
        raise NonFiniteUpdate(f"non-finite loss {loss.item()} at update {record.update_count}")
    loss.backward()
    record.add_micro_batch(len(micro), metrics)
    return loss.item()


def _denominators(step: _Step, rows: list[int],
                  micros: list[list[int]]) -> list[objectives.Denominator]:
    """Each micro-batch's share of its optimizer step, which its loss is divided by."""
    batch = step.batch

    def lengths(indexes: list[int]) -> list[int]:  # masked (truncated) rows leave the divisor
        return [len(batch.completion_token_ids[i]) for i in indexes if batch.contributing(i)]

    step_lengths = lengths(rows)
    return [objectives.Denominator(step_lengths=step_lengths, micro_lengths=lengths(micro),
                                   micro_batches=len(micros)) for micro in micros]


def _optimizer_step(step: _Step, optimizer, parameters, rows: list[int], record: UpdateRecord,
                    advance=None) -> None:
    optimizer.zero_grad(set_to_none=True)
    micros = micro_batches(step.batch, rows, step.settings.micro_batch_size)
    mine = data_parallel.deal(step.world, list(zip(micros, _denominators(step, rows, micros))))
    step_loss = [0.0]

    def work() -> None:
        for micro, denominator in mine:
            step_loss[0] += _backward_micro_batch(step, micro, denominator, record)
            if advance is not None:
                advance(len(micro))

    _run_agreed(step, optimizer, work)
    if step.world.distributed:
        step.world.all_reduce_gradients(parameters)
        step_loss[0] = step.world.sum_floats(step_loss)[0]
        if advance is not None:  # the other ranks' sequences, for the progress bar
            advance(len(rows) - sum(len(micro) for micro, _ in mine))
    step_loss = step_loss[0]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, step.settings.max_grad_norm))
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteUpdate(f"non-finite gradient norm at update {record.update_count}")
    optimizer.step()
    record.update_count += 1
    record.losses.append(step_loss)
    record.grad_norms.append(grad_norm)


def grpo_update(model, optimizer, batch: UpdateBatch, settings: UpdateSettings, pad_id: int,
                reference_mode, parameters, advance=None, world: World = SINGLE) -> UpdateRecord:
    """Run the optimizer steps of one rollout's valid groups; returns the update record.

    `num_iterations` passes over the rollout, each split into `step_plan`'s optimizer steps.
    `reference_mode` is a context manager factory that switches `model` to the baseline policy;
    `advance(n)` (if given) is told of every n sequences back-propagated.
    """
    record = UpdateRecord()
    if len(batch) == 0:
        return record
    parameters = list(parameters)
    plan = step_plan(batch, settings.groups_per_update)
    step = _Step(model=model, batch=batch, settings=settings, pad_id=pad_id,
                 reference_mode=reference_mode, device=next(model.parameters()).device,
                 old_logp={}, record=record, world=world)
    if batch.old_logprobs is not None:
        # The sampler drew from a truncated distribution (top_k / top_p / min_p): that, not
        # the trainer's full softmax, is the behaviour policy the ratio divides by.
        step.old_logp = {i: torch.tensor(values, device=step.device, dtype=torch.float32)
                         for i, values in enumerate(batch.old_logprobs)}
    elif len(plan) * settings.num_iterations > 1:
        # later steps need the rollout policy's log-probs, fixed before step one
        step.old_logp = rollout_logprobs(step, [i for rows in plan for i in rows], optimizer)
    for iteration in range(settings.num_iterations):
        step.iteration = iteration
        record.pass_tokens.append(0)
        record.pass_clipped.append(0)
        record.pass_max_abs_log_ratio.append(0.0)
        for rows in plan:
            _optimizer_step(step, optimizer, parameters, rows, record, advance)
    return merge_records(world, record)


def merge_records(world: World, record: UpdateRecord) -> UpdateRecord:
    """The whole step's record from every rank's part (losses and gradient norms were reduced
    before each optimizer step)."""
    return UpdateRecord(**data_parallel.merge_counts(
        world, dataclasses.asdict(record), maxima=("mismatch_abs_max", "pass_max_abs_log_ratio"),
        same=("update_count", "losses", "grad_norms")))


# --- all-or-nothing: roll back on any failure, retry once after an out-of-memory -------------


def update_with_retry(model, optimizer, batch: UpdateBatch, settings: UpdateSettings, pad_id: int,
                      reference_mode, parameters, advance=None,
                      on_retry=None, world: World = SINGLE) -> tuple[UpdateRecord, UpdateSettings]:
    """`grpo_update`, all or nothing: returns (record, the settings that succeeded).

    Any failure restores the parameters and optimizer state of before the call, so a step is
    never half-applied (with several optimizer steps per rollout, earlier ones would otherwise
    stay in the adapter without a record) and the kept adapter is the last good one. An
    out-of-memory error is retried once at half the micro-batch, from the restored state and
    with zeroed gradients, so no optimizer step is applied twice; a second one raises
    UpdateFailed. NonFiniteUpdate and every other error propagate after the rollback.
    """
    snapshot = TrainingSnapshot.take(parameters, optimizer)
    try:
        return grpo_update(model, optimizer, batch, settings, pad_id, reference_mode, parameters,
                           advance, world), settings
    except Exception as error:
        snapshot.restore(parameters, optimizer)
        if not is_out_of_memory(error):
            raise
        first = first_line(error)
    if settings.micro_batch_size == 1:
        raise UpdateFailed(f"out of memory during the update at micro_batch_size 1: {first}")
    release_cached_memory()
    halved = dataclasses.replace(settings, micro_batch_size=settings.micro_batch_size // 2)
    if on_retry is not None:
        on_retry(first, halved.micro_batch_size)
    try:
        return grpo_update(model, optimizer, batch, halved, pad_id, reference_mode, parameters,
                           advance, world), halved
    except Exception as error:
        snapshot.restore(parameters, optimizer)
        if is_out_of_memory(error):
            raise UpdateFailed(
                f"out of memory during the update at micro_batch_size {settings.micro_batch_size} "
                f"and again at {halved.micro_batch_size}: {first_line(error)}; lower "
                "micro_batch_size or max_new_tokens") from error
        raise
