"""Update: group-relative advantages, the valid-group filter, the clipped GRPO loss, optimizer steps.

Where this departs from the DeepSeekMath GRPO objective (Shao et al. 2024, eq. 3), and why:
- Groups whose rewards are all equal have zero advantage everywhere, so their policy-gradient
  term is exactly zero; they never enter a forward or backward pass. Their KL term is dropped
  with them: the KL penalty only acts on the tokens we actually train on.
- Advantages are (r - mean) / (std + 1e-4) with the unbiased within-group std (as TRL and verl).
- The KL term is the k3 estimator exp(ref - logp) - (ref - logp) - 1 per token, against the
  baseline policy (adapter disabled, or the frozen baseline adapter) — not a second model copy.
- Each group's prompt is forwarded once and its KV cache shared by its G completions
  (`logprobs.shared_prompt_logprobs`); the result equals one forward per sequence.
- With one optimizer step per rollout the rollout policy *is* the current policy, so its
  log-probs are the detached current ones (ratio 1, clip inactive, same gradient) and no extra
  forward is spent; with several steps per rollout they are computed once before the first step.
- `loss_aggregation="sequence_mean"` is the paper's token mean per sequence then mean over
  sequences; "token_mean" (DAPO) averages over all tokens of the optimizer step.
Shapes: N sequences per micro-batch, T completion tokens (right-padded), B groups of G.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

import torch

from grpogate.logprobs import pack_groups, shared_prompt_logprobs

ADVANTAGE_EPS = 1e-4


class NonFiniteUpdate(RuntimeError):
    """A NaN/inf loss or gradient: the optimizer step was not taken."""


class UpdateFailed(RuntimeError):
    """The update ran out of memory again after the retry at half the micro-batch."""


# --- advantages and the valid-group filter ---------------------------------------------------


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """rewards [B, G] -> advantages [B, G], normalized within each group."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)  # unbiased, as TRL / verl
    return (rewards - mean) / (std + ADVANTAGE_EPS)


def valid_group_mask(rewards: torch.Tensor) -> torch.Tensor:
    """rewards [B, G] -> [B] bool: groups whose rewards differ, the only ones with a gradient."""
    return rewards.max(dim=1).values > rewards.min(dim=1).values


@dataclass
class UpdateBatch:
    """The sequences of the valid groups, with their advantages; plain lists, easy to shard."""

    prompt_token_ids: list[list[int]]
    completion_token_ids: list[list[int]]
    advantages: list[float]
    group_index: list[int]  # which valid group (0..valid_groups-1) each sequence belongs to

    def __len__(self) -> int:
        return len(self.advantages)

    @property
    def group_count(self) -> int:
        return len(set(self.group_index))

    @property
    def group_size(self) -> int:
        """Sequences per group (every group is complete: `build_update_batch` checks it)."""
        return len(self) // self.group_count if len(self) else 0


def build_update_batch(prompt_token_ids: list[list[int]], completion_token_ids: list[list[int]],
                       rewards: list[float], group_size: int) -> UpdateBatch:
    """Sequences arrive grouped (G consecutive per prompt); keep only the valid groups'."""
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} completions do not form complete groups of {group_size}")
    reward_matrix = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)  # [B, G]
    advantages = group_advantages(reward_matrix)  # [B, G]
    valid = valid_group_mask(reward_matrix)  # [B]
    batch = UpdateBatch([], [], [], [])
    for valid_index, group in enumerate(torch.nonzero(valid).flatten().tolist()):
        for member in range(group_size):
            row = group * group_size + member
            batch.prompt_token_ids.append(prompt_token_ids[row])
            batch.completion_token_ids.append(completion_token_ids[row])
            batch.advantages.append(float(advantages[group, member]))
            batch.group_index.append(valid_index)
    return batch


# --- the loss ----------------------------------------------------------------------------------


def grpo_token_terms(logp, old_logp, ref_logp, advantages, clip_epsilon: float, kl_coef: float):
    """Per-token loss, KL and clipped flags; logp/old/ref [N, T], advantages [N]."""
    ratio = torch.exp(logp - old_logp)  # [N, T]
    advantage = advantages[:, None]  # [N, 1]
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon) * advantage
    surrogate = torch.minimum(unclipped, clipped)
    if ref_logp is None:
        kl = torch.zeros_like(logp)
    else:
        log_ratio = ref_logp - logp
        kl = torch.exp(log_ratio) - log_ratio - 1  # k3 estimator, >= 0
    per_token = -(surrogate - kl_coef * kl)
    was_clipped = ((ratio < 1 - clip_epsilon) & (advantage < 0)) | (
        (ratio > 1 + clip_epsilon) & (advantage > 0))
    return per_token, kl, was_clipped


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """The *sum* form of the loss over a micro-batch; divide by `loss_denominator` of the step."""
    if aggregation == "sequence_mean":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    if aggregation == "token_mean":
        return (per_token * mask).sum()
    raise ValueError(f"unknown loss aggregation {aggregation!r}")


def loss_denominator(completion_lengths: list[int], aggregation: str) -> int:
    return len(completion_lengths) if aggregation == "sequence_mean" else max(1, sum(completion_lengths))


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, clip_epsilon, kl_coef, aggregation):
    """Whole-batch loss (tests and a single micro-batch): the aggregated mean."""
    per_token, _, _ = grpo_token_terms(logp, old_logp, ref_logp, advantages, clip_epsilon, kl_coef)
    lengths = mask.sum(-1).long().tolist()
    return aggregate_loss(per_token, mask, aggregation) / loss_denominator(lengths, aggregation)


# --- the optimizer steps ---------------------------------------------------------------------


@dataclass
class UpdateSettings:
    clip_epsilon: float
    kl_coef: float
    max_grad_norm: float
    micro_batch_size: int
    groups_per_update: int  # 0: all valid groups in one optimizer step
    loss_aggregation: str
    temperature: float


@dataclass
class UpdateRecord:
    update_count: int = 0  # optimizer steps that really happened
    sequences: int = 0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    kl_sum: float = 0.0
    clipped_tokens: int = 0

    def summary(self) -> dict:
        return {
            "update_count": self.update_count,
            "sequences": self.sequences,
            "tokens": self.tokens,
            "loss": self.losses,
            "grad_norm": self.grad_norms,
            "mean_kl": self.kl_sum / self.tokens if self.tokens else 0.0,
            "clip_fraction": self.clipped_tokens / self.tokens if self.tokens else 0.0,
        }


def _chunks(indexes: list[int], size: int) -> list[list[int]]:
    return [indexes[i:i + size] for i in range(0, len(indexes), size)]


def _step_plan(batch: UpdateBatch, groups_per_update: int) -> list[list[int]]:
    """Sequence indexes of each optimizer step, whole groups at a time."""
    groups = sorted(set(batch.group_index))
    per_step = groups_per_update or len(groups)
    plan = []
    for step_groups in _chunks(groups, per_step):
        wanted = set(step_groups)
        plan.append([i for i, g in enumerate(batch.group_index) if g in wanted])
    return plan


def grpo_update(model, optimizer, batch: UpdateBatch, settings: UpdateSettings, pad_id: int,
                reference_mode, parameters, progress=None) -> UpdateRecord:
    """Run the optimizer steps of one rollout's valid groups; returns the update record.

    `reference_mode` is a context manager factory that switches `model` to the baseline policy.
    """
    record = UpdateRecord()
    if len(batch) == 0:
        return record
    device = next(model.parameters()).device
    plan = _step_plan(batch, settings.groups_per_update)
    group_size = batch.group_size

    def logprobs(rows):
        """Log-probs [len(rows), T] and completion mask; rows are whole groups, group-major."""
        prompt_ids, prompt_mask, completion_ids, mask = pack_groups(
            [batch.prompt_token_ids[i] for i in rows[::group_size]],
            [batch.completion_token_ids[i] for i in rows], pad_id, device)
        return (lambda: shared_prompt_logprobs(model, prompt_ids, prompt_mask, completion_ids,
                                               mask, group_size, settings.temperature)), mask

    def micro_batches(rows):
        # Whole groups (they share one prompt forward), groups of similar longest completion
        # together so little compute goes to padding.
        members: dict[int, list[int]] = {}
        for index in rows:
            members.setdefault(batch.group_index[index], []).append(index)
        groups = sorted(members.values(),
                        key=lambda group: max(len(batch.completion_token_ids[i]) for i in group))
        per_micro = max(1, settings.micro_batch_size // group_size)
        return [[i for group in groups[k:k + per_micro] for i in group]
                for k in range(0, len(groups), per_micro)]

    old_logp: dict[int, torch.Tensor] = {}
    if len(plan) > 1:  # later steps need the rollout policy's log-probs, fixed before step one
        with torch.no_grad():
            for rows in micro_batches([i for step in plan for i in step]):
                forward, _ = logprobs(rows)
                for row, values in zip(rows, forward()):
                    old_logp[row] = values

    for rows in plan:
        optimizer.zero_grad(set_to_none=True)
        lengths = [len(batch.completion_token_ids[i]) for i in rows]
        denominator = loss_denominator(lengths, settings.loss_aggregation)
        step_loss = 0.0
        for micro in micro_batches(rows):
            forward, mask = logprobs(micro)
            ref_logp = None
            if settings.kl_coef > 0:
                with torch.no_grad(), reference_mode():
                    ref_logp = forward()
            logp = forward()
            if old_logp:
                # Rows were precomputed in micro-batches of other widths: copy each row's
                # prefix (which covers its completion) over the detached current log-probs,
                # so padded positions have ratio 1 and never produce inf * 0.
                old = logp.detach().clone()
                for row, index in enumerate(micro):
                    values = old_logp[index][:logp.shape[1]]
                    old[row, :values.shape[0]] = values
            else:
                old = logp.detach()
            advantages = torch.tensor([batch.advantages[i] for i in micro], device=device,
                                      dtype=logp.dtype)
            per_token, kl, was_clipped = grpo_token_terms(
                logp, old, ref_logp, advantages, settings.clip_epsilon, settings.kl_coef)
            loss = aggregate_loss(per_token, mask, settings.loss_aggregation) / denominator
            if not torch.isfinite(loss):
                optimizer.zero_grad(set_to_none=True)
                raise NonFiniteUpdate(f"non-finite loss {loss.item()} at update {record.update_count}")
            loss.backward()
            step_loss += loss.item()
            record.kl_sum += float((kl.detach() * mask).sum())
            record.clipped_tokens += int((was_clipped & mask.bool()).sum())
            record.tokens += int(mask.sum())
            record.sequences += len(micro)
            if progress is not None:
                progress(len(micro))
        grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, settings.max_grad_norm))
        if not math.isfinite(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteUpdate(f"non-finite gradient norm at update {record.update_count}")
        optimizer.step()
        record.update_count += 1
        record.losses.append(step_loss)
        record.grad_norms.append(grad_norm)
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
                      reference_mode, parameters, progress=None,
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
                           progress), settings
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
                           progress), halved
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
