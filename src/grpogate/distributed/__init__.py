"""Several processes: torch.distributed as torchrun launches it (gloo on CPU, NCCL on GPU).

A `World` is this process's place in the job: its rank, the world size, the backend, and the
few collectives the run needs. Outside torchrun (no WORLD_SIZE in the environment, or 1) it is
the one-process world, whose collectives return their input without touching
torch.distributed, so a one-process run takes exactly the code path it always took.

What the run shares, and why each is enough (docs/design.md §9):
- prompts are sharded (`shard`), and every rank gathers the whole step's completions, so each
  holds the same records, the same advantages and the same decisions (dynamic sampling's
  refill, the contract) without a further message;
- the update's micro-batches are the one-process plan dealt round-robin; the gradients are
  summed (`all_reduce_gradients`), each micro-batch already divided by the whole step's
  denominator, so the sum is the one-process gradient;
- flags (stop requests, a NaN, an out-of-memory) are agreed (`any_rank`) before anyone acts.
torchrun's elastic agent restarts a failed group; `restart_count` and `job_id` tell a
restarted worker that it belongs to the same job, and `elastic` (this package's other module,
which sits on top: it needs the checkpoints) finds that job's run for pipeline.py to resume.
The update's share of the deal is training/data_parallel.py.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = "none"  # "gloo", "nccl", or "none" for one process
    restart_count: int = 0  # TORCHELASTIC_RESTART_COUNT: how often the agent restarted the group
    job_id: str = ""  # TORCHELASTIC_RUN_ID: the rendezvous id, the same over restarts
    # Seconds this process spent inside collectives (waiting for the slowest rank, mostly):
    # a stage's wall time minus its growth is the rank's own work (`own_seconds`).
    waited: dict = field(default_factory=lambda: {"seconds": 0.0}, compare=False)

    def waiting(self):
        return _Waiting(self.waited)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that writes files, prints and logs to trackers."""
        return self.rank == 0

    def describe(self) -> dict:
        return {"world_size": self.world_size, "backend": self.backend,
                "restart_count": self.restart_count}

    # --- collectives (the identity in a one-process world) ---------------------------------

    def all_gather_object(self, value) -> list:
        """[value of rank 0, value of rank 1, ...] on every rank (pickled; small records)."""
        if not self.distributed:
            return [value]
        gathered = [None] * self.world_size
        with self.waiting():
            dist.all_gather_object(gathered, value)
        return gathered

    def broadcast_object(self, value):
        """Rank 0's `value` on every rank."""
        if not self.distributed:
            return value
        box = [value]
        with self.waiting():
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any: an agreement, never a one-rank act."""
        if not self.distributed:
            return bool(flag)
        value = torch.tensor([1.0 if flag else 0.0], device=self.device())
        with self.waiting():
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item() > 0)

    def sum_floats(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks, in float64."""
        if not self.distributed or not values:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device())
        with self.waiting():
            dist.all_reduce(tensor)
        return tensor.tolist()

    def all_reduce_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over ranks, in one flat buffer. A rank that ran no
        micro-batch this step contributes zeros (and still joins: no rank is left waiting)."""
        if not self.distributed:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = torch.cat([g.reshape(-1) for g in grads])  # [sum of numels]
        with self.waiting():
            dist.all_reduce(flat)
        offset = 0
        for parameter, grad in zip(parameters, grads):
            parameter.grad = flat[offset:offset + grad.numel()].view_as(grad).clone()
            offset += grad.numel()

    def barrier(self) -> None:
        if self.distributed:
            with self.waiting():
                dist.barrier()

    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


class _Waiting:
    def __init__(self, waited: dict):
        self.waited = waited

    def __enter__(self):
        self.started = time.perf_counter()

    def __exit__(self, *exc):
        self.waited["seconds"] += time.perf_counter() - self.started


class StageClock:
    """A stage's wall seconds on this rank and its own (outside collectives)."""

    def __init__(self, world: World):
        self.world = world
        self.started = time.perf_counter()
        self.waited_before = world.waited["seconds"]

    def wall(self) -> float:
        return time.perf_counter() - self.started

    def own(self) -> float:
        return self.wall() - (self.world.waited["seconds"] - self.waited_before)


def agree_stop(world: World, stop) -> bool:
    """Whether any rank was asked to stop (SIGINT / SIGTERM); every rank then stops at this
    same safe point, all recording the first asking rank's signal."""
    if not world.distributed:
        return stop.requested
    names = world.all_gather_object(stop.signal_name)
    asked = [name for name in names if name]
    if asked and not stop.requested:
        stop.signal_name = asked[0]
    return bool(asked)


SINGLE = World()


def shard(count: int, world: World) -> list[int]:
    """The positions 0..count-1 this rank takes, dealt round-robin (balanced to one item)."""
    return list(range(world.rank, count, world.world_size))


def in_shard_order(parts: list[list[tuple]]) -> list[tuple]:
    """Every rank's (position, ...) items, gathered as `parts`, as one list in position order:
    the sharded work listed as one process would have listed it."""
    return sorted((item for part in parts for item in part), key=lambda item: item[0])


def init_world() -> World:
    """Join the process group torchrun described in the environment, or the one-process world.

    NCCL when this process has a GPU, gloo otherwise; each local rank takes its own GPU."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    job_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if world_size <= 1:
        return World(restart_count=restart_count, job_id=job_id)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, **_attempt_store(restart_count, world_size))
    return World(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                 backend=backend, restart_count=restart_count, job_id=job_id)


def _attempt_store(restart_count: int, world_size: int) -> dict:
    """The process group's store, keyed by the attempt under torchrun's agent store.

    torchrun shares its rendezvous TCPStore with the workers (MASTER_PORT) over every restart
    of the group, and env:// rendezvous adds no per-attempt prefix: a restarted group could
    read the dead group's gloo addresses (seen here: "Connection refused" to the killed
    worker's port). A prefix per attempt keeps each group to its own keys."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    from datetime import timedelta

    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           world_size, is_master=False, timeout=timedelta(minutes=10))
    return {"store": dist.PrefixStore(f"grpogate/attempt_{restart_count}", client),
            "rank": int(os.environ["RANK"]), "world_size": world_size}


def close_world(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
