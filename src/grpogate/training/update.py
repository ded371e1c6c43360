"""Update: the optimizer steps of one rollout's valid groups, all or nothing.

Where this departs from the DeepSeekMath GRPO objective (Shao et al. 2024, eq. 3), and why:
- Only valid groups (rewards not all equal) are forwarded (`advantages.build_update_batch`):
  the others have zero advantage, so zero gradient; their KL term is dropped with them.
- The KL term is the k3 estimator against the baseline policy (adapter disabled, or the frozen
  baseline adapter) — not a second model copy (`objectives.grpo_token_terms`).
- Each group's prompt is forwarded once and its KV cache shared by its G completions
  (`logprobs.shared_prompt_logprobs`); the result equals one forward per sequence.
- With one optimizer step per rollout the rollout policy *is* the current policy, so its
  log-probs are the detached current ones (ratio 1, clip inactive, same gradient) and no extra
  forward is spent; with several steps per rollout they are computed once before the first step.
  When the sampler truncates its distribution (top_k / top_p / min_p), the old log-probs are
  the sampler's own under that truncated, renormalized distribution, so the ratio is taken
  against what was really sampled from (it is then <= 1 on kept tokens at the first step).
- With `mask_truncated_completions`, completions that hit max_new_tokens add no loss and do not
  count in the loss denominator (sequences or tokens); their advantages are computed with them.
- Any failure rolls the adapter and optimizer back to before the rollout's update; an
  out-of-memory error is retried once at half the micro-batch.
Shapes: N sequences per micro-batch, T completion tokens (right-padded), B groups of G.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

import torch

from grpogate.config import RunConfig
from grpogate.training import objectives
from grpogate.training.advantages import UpdateBatch
from grpogate.training.logprobs import PackedGroups, pack_groups, shared_prompt_logprobs


class NonFiniteUpdate(RuntimeError):
    """A NaN/inf loss or gradient: the optimizer step was not taken."""


class UpdateFailed(RuntimeError):
    """The update ran out of memory again after the retry at half the micro-batch."""


@dataclass
class UpdateSettings:
    clip_epsilon: float
    kl_coef: float
    max_grad_norm: float
    micro_batch_size: int
    groups_per_update: int  # 0: all valid groups in one optimizer step
    loss_aggregation: str
    temperature: float

    @classmethod
    def from_config(cls, config: RunConfig) -> "UpdateSettings":
        return cls(config.clip_epsilon, config.kl_coef, config.max_grad_norm,
                   config.micro_batch_size, config.groups_per_update, config.loss_aggregation,
                   config.temperature)


@dataclass
class UpdateRecord:
    update_count: int = 0  # optimizer steps that really happened
    sequences: int = 0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    kl_sum: float = 0.0
    clipped_tokens: int = 0
    masked_sequences: int = 0  # forwarded for their group but adding no loss (truncated)

    def summary(self) -> dict:
        return {
            "update_count": self.update_count,
            "sequences": self.sequences,
            "masked_truncated_sequences": self.masked_sequences,
            "tokens": self.tokens,
            "loss": self.losses,
            "grad_norm": self.grad_norms,
            "mean_kl": self.kl_sum / self.tokens if self.tokens else 0.0,
            "clip_fraction": self.clipped_tokens / self.tokens if self.tokens else 0.0,
        }


# --- which rows go where -----------------------------------------------------------------------


def _chunks(indexes: list[int], size: int) -> list[list[int]]:
    return [indexes[i:i + size] for i in range(0, len(indexes), size)]


def step_plan(batch: UpdateBatch, groups_per_update: int) -> list[list[int]]:
    """Sequence indexes of each optimizer step, whole groups at a time."""
    groups = sorted(set(batch.group_index))
    per_step = groups_per_update or len(groups)
    plan = []
    for step_groups in _chunks(groups, per_step):
        wanted = set(step_groups)
        plan.append([i for i, g in enumerate(batch.group_index) if g in wanted])
    return plan


def micro_batches(batch: UpdateBatch, rows: list[int], micro_batch_size: int) -> list[list[int]]:
    """Whole groups per micro-batch (they share one prompt forward), groups of similar longest
    completion together so little compute goes to padding."""
    members: dict[int, list[int]] = {}
    for index in rows:
        members.setdefault(batch.group_index[index], []).append(index)
    groups = sorted(members.values(),
                    key=lambda group: max(len(batch.completion_token_ids[i]) for i in group))
    per_micro = max(1, micro_batch_size // batch.group_size)
    return [[i for group in groups[k:k + per_micro] for i in group]
            for k in range(0, len(groups), per_micro)]


def pack_rows(batch: UpdateBatch, rows: list[int], pad_id: int, device) -> PackedGroups:
    """Rows are whole groups, group-major: one prompt per group, its G completions."""
    return pack_groups([batch.prompt_token_ids[i] for i in rows[::batch.group_size]],
                       [batch.completion_token_ids[i] for i in rows], pad_id, device)


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

    def logprobs(self, packed: PackedGroups) -> torch.Tensor:
        return shared_prompt_logprobs(self.model, packed, self.batch.group_size,
                                      self.settings.temperature)


def rollout_logprobs(step: _Step, rows: list[int]) -> dict[int, torch.Tensor]:
    """The rollout policy's log-probs of `rows`, fixed before the first optimizer step."""
    old_logp = {}
    with torch.no_grad():
        for micro in micro_batches(step.batch, rows, step.settings.micro_batch_size):
            values = step.logprobs(pack_rows(step.batch, micro, step.pad_id, step.device))
            old_logp.update(zip(micro, values))
    return old_logp


def _old_logprobs(step: _Step, logp: torch.Tensor, micro: list[int]) -> torch.Tensor:
    if not step.old_logp:
        return logp.detach()
    # Rows were precomputed in micro-batches of other widths: copy each row's prefix (which
    # covers its completion) over the detached current log-probs, so padded positions have
    # ratio 1 and never produce inf * 0.
    old = logp.detach().clone()
    for row, index in enumerate(micro):
        values = step.old_logp[index][:logp.shape[1]]
        old[row, :values.shape[0]] = values
    return old


def _backward_micro_batch(step: _Step, micro: list[int], denominator: int,
                          record: UpdateRecord) -> float:
    """Forward (reference, then policy), loss, backward for one micro-batch; returns its loss."""
    settings = step.settings
    packed = pack_rows(step.batch, micro, step.pad_id, step.device)
    ref_logp = None
    if settings.kl_coef > 0:
        with torch.no_grad(), step.reference_mode():
            ref_logp = step.logprobs(packed)
    logp = step.logprobs(packed)
    advantages = torch.tensor([step.batch.advantages[i] for i in micro], device=step.device,
                              dtype=logp.dtype)
    # mask_truncated_completions: a cut-off completion's tokens leave the loss (and its
    # denominator) but stay in their group's advantages, computed before the update.
    contributes = torch.tensor([step.batch.contributing(i) for i in micro], device=step.device,
                               dtype=packed.completion_mask.dtype)  # [N]
    mask = packed.completion_mask * contributes[:, None]  # [N, T]
    loss, kl, was_clipped = objectives.micro_batch_loss(
        logp, _old_logprobs(step, logp, micro), ref_logp, advantages, mask,
        clip_epsilon=settings.clip_epsilon, kl_coef=settings.kl_coef,
        aggregation=settings.loss_aggregation, denominator=denominator)
    if not torch.isfinite(loss):
        raise NonFiniteUpdate(f"non-finite loss {loss.item()} at update {record.update_count}")
    loss.backward()
    record.kl_sum += float((kl.detach() * mask).sum())
    record.clipped_tokens += int((was_clipped & mask.bool()).sum())
    record.tokens += int(mask.sum())
    record.sequences += len(micro)
    record.masked_sequences += len(micro) - int(contributes.sum())
    return loss.item()


def _optimizer_step(step: _Step, optimizer, parameters, rows: list[int], record: UpdateRecord,
                    advance=None) -> None:
    optimizer.zero_grad(set_to_none=True)
    lengths = [len(step.batch.completion_token_ids[i]) for i in rows if step.batch.contributing(i)]
    denominator = objectives.loss_denominator(lengths, step.settings.loss_aggregation)
    step_loss = 0.0
    for micro in micro_batches(step.batch, rows, step.settings.micro_batch_size):
        try:
            step_loss += _backward_micro_batch(step, micro, denominator, record)
        except NonFiniteUpdate:
            optimizer.zero_grad(set_to_none=True)
            raise
        if advance is not None:
            advance(len(micro))
    grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, step.settings.max_grad_norm))
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteUpdate(f"non-finite gradient norm at update {record.update_count}")
    optimizer.step()
    record.update_count += 1
    record.losses.append(step_loss)
    record.grad_norms.append(grad_norm)


def grpo_update(model, optimizer, batch: UpdateBatch, settings: UpdateSettings, pad_id: int,
                reference_mode, parameters, advance=None) -> UpdateRecord:
    """Run the optimizer steps of one rollout's valid groups; returns the update record.

    `reference_mode` is a context manager factory that switches `model` to the baseline policy;
    `advance(n)` (if given) is told of every n sequences back-propagated.
    """
    record = UpdateRecord()
    if len(batch) == 0:
        return record
    parameters = list(parameters)
    plan = step_plan(batch, settings.groups_per_update)
    step = _Step(model, batch, settings, pad_id, reference_mode,
                 next(model.parameters()).device, {})
    if batch.old_logprobs is not None:
        # The sampler drew from a truncated distribution (top_k / top_p / min_p): that, not
        # the trainer's full softmax, is the behaviour policy the ratio divides by.
        step.old_logp = {i: torch.tensor(values, device=step.device, dtype=torch.float32)
                         for i, values in enumerate(batch.old_logprobs)}
    elif len(plan) > 1:  # later steps need the rollout policy's log-probs, fixed before step one
        step.old_logp = rollout_logprobs(step, [i for rows in plan for i in rows])
    for rows in plan:
        _optimizer_step(step, optimizer, parameters, rows, record, advance)
    return record


# --- all-or-nothing updates: rollback, and one retry after an out-of-memory ---------------------


@dataclass
class TrainingSnapshot:
    """CPU copies of the trainable parameters and the optimizer state before a rollout's update."""

    parameters: list[torch.Tensor]
    optimizer_state: dict

    @classmethod
    def take(cls, parameters, optimizer) -> "TrainingSnapshot":
        def to_cpu(value):
            if isinstance(value, torch.Tensor):
                return value.detach().to("cpu", copy=True)
            if isinstance(value, dict):
                return {key: to_cpu(item) for key, item in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(to_cpu(item) for item in value)
            return value

        return cls([p.detach().to("cpu", copy=True) for p in parameters],
                   to_cpu(optimizer.state_dict()))

    def restore(self, parameters, optimizer) -> None:
        with torch.no_grad():
            for parameter, saved in zip(parameters, self.parameters):
                parameter.copy_(saved.to(parameter.device))
        # load_state_dict keeps CPU tensors as they are; a deep copy keeps the snapshot intact
        # for a second restore after the retry.
        optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))
        optimizer.zero_grad(set_to_none=True)


def is_out_of_memory(error: BaseException) -> bool:
    out_of_memory = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    return isinstance(error, out_of_memory) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


def update_with_retry(model, optimizer, batch: UpdateBatch, settings: UpdateSettings, pad_id: int,
                      reference_mode, parameters, advance=None,
                      on_retry=None) -> tuple[UpdateRecord, UpdateSettings]:
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
                           advance), settings
    except Exception as error:
        snapshot.restore(parameters, optimizer)
        if not is_out_of_memory(error):
            raise
        first = _first_line(error)
    if settings.micro_batch_size == 1:
        raise UpdateFailed(f"out of memory during the update at micro_batch_size 1: {first}")
    _release_cached_memory()
    halved = dataclasses.replace(settings, micro_batch_size=settings.micro_batch_size // 2)
    if on_retry is not None:
        on_retry(first, halved.micro_batch_size)
    try:
        return grpo_update(model, optimizer, batch, halved, pad_id, reference_mode, parameters,
                           advance), halved
    except Exception as error:
        snapshot.restore(parameters, optimizer)
        if is_out_of_memory(error):
            raise UpdateFailed(
                f"out of memory during the update at micro_batch_size {settings.micro_batch_size} "
                f"and again at {halved.micro_batch_size}: {_first_line(error)}; lower "
                "micro_batch_size or max_new_tokens") from error
        raise


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _release_cached_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
