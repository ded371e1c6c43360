"""Data parallel: how one rollout's update is shared by the ranks of a torchrun job.

Every rank holds the whole step's update batch (the rollout gathers every completion), so the
ranks only split the work and agree on its outcome:
- `deal`: the k-th micro-batch of the one-process plan goes to rank k % world size, with the
  denominator it has in one process; the summed gradients are then the one-process gradient.
- `run_agreed`: a rank's NaN or out-of-memory is told to every rank before any of them acts,
  so all roll back (or retry at half the micro-batch) together and no rank waits forever in a
  collective the others have left.
- `merge_counts`: the step's record from every rank's part.
With one process each is the identity (no collective is called).
"""

from __future__ import annotations

from grpogate.distributed import World, shard
from grpogate.training.rollback import first_line


def deal(world: World, items: list) -> list:
    """This rank's share: items[rank], items[rank + world size], ... — the round-robin rule
    the rollout shards its prompts by (`distributed.shard`)."""
    return [items[k] for k in shard(len(items), world)]


def run_agreed(world: World, work, kind_of) -> tuple[BaseException | None, tuple | None]:
    """Run `work()`; an error that `kind_of(error)` names (e.g. "non_finite") is caught and
    agreed on, any other propagates at once. Returns (this rank's caught error, the first
    failing rank's (rank, kind, message)) — both None when every rank succeeded."""
    failure = None
    try:
        work()
    except Exception as error:  # noqa: BLE001 (re-raised unless kind_of names it)
        if kind_of(error) is None:
            raise
        failure = error
    mine = None if failure is None else (kind_of(failure), first_line(failure))
    reports = world.all_gather_object(mine)
    failed = [(rank, *report) for rank, report in enumerate(reports) if report is not None]
    return failure, (failed[0] if failed else None)


def gather_rows(world: World, values: dict) -> dict:
    """Every rank's {row: tensor} merged, on every rank (tensors travel on the CPU)."""
    if not world.distributed:
        return values
    device = next(iter(values.values())).device if values else None
    parts = world.all_gather_object({row: value.cpu() for row, value in values.items()})
    merged = {row: value for part in parts for row, value in part.items()}
    return {row: value.to(device) if device else value for row, value in merged.items()}


def merge_counts(world: World, fields: dict, *, maxima=(), same=()) -> dict:
    """`fields` summed over ranks (lists element-wise); names in `maxima` take the largest,
    names in `same` (already reduced, equal on every rank) rank 0's."""
    if not world.distributed:
        return fields
    parts = world.all_gather_object(fields)
    merged = dict(parts[0])
    for name, value in merged.items():
        values = [part[name] for part in parts]
        if name in same:
            continue
        reduce = max if name in maxima else sum
        merged[name] = ([reduce(column) for column in zip(*values)] if isinstance(value, list)
                        else reduce(values))
    return merged
