"""The seeding rule (docs/design.md §8): which seed every sampling call of a run uses.

Sampling and training use it, the evidence records it and `decide --replay` redraws by it, so it
lives below all of them. Seeds follow the step, the generation round and the prompt's index in
its problem set, never a rank or a batch: that is what makes a run's completions independent of
the number of processes.
"""

from __future__ import annotations

import hashlib

EVAL_SEED_OFFSET = 10_000  # the re-test samples with seed = run seed + 10,000
REFILL_SEED_OFFSET = 1_000_000  # refill round r >= 1 of step s samples with seed + s + r x this


def rollout_seed(run_seed: int, step: int, generation_round: int = 0) -> int:
    """Step s samples with run seed + s; its dynamic-sampling refill round r with
    run seed + s + r x 1,000,000, so no two rounds of a run share a seed."""
    return run_seed + step + REFILL_SEED_OFFSET * generation_round


def eval_seed(run_seed: int) -> int:
    """The re-test's seed, the same for baseline and candidate (their completions pair up)."""
    return run_seed + EVAL_SEED_OFFSET


def prompt_seed(seed: int, prompt_index: int) -> int:
    """The sampling seed of one prompt's G completions under a round's (or the re-test's)
    `seed`: sha256 of both, 63 bits. Derived from the prompt's index in its problem set, never
    from a rank or a batch, so a run's completions do not depend on the number of processes."""
    digest = hashlib.sha256(f"{seed}|{prompt_index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2 ** 63 - 1)
