"""How close generation can get to the ideal on the benchmark's own rollouts: a measured bound.

    python bench/decode_bound.py [--rounds 3] [--prompts 8] [--group-size 8] [--max-new-tokens 48]

The peak fraction divides generation tokens/s by the ideal at the full batch (64 rows), but a
rollout does not stay at 64 rows: a row that emits EOS leaves the batch, and the last steps
carry the few long completions. This script samples the benchmark's rollouts with grpogate's
decoder, records every piece of work (rows of each decode step, the prefill's prompt tokens)
and its measured seconds, then times the same model's matrix products alone at each of those
row counts with the ideal's fastest kernel. It prints, per round and in total:

- `actual`: tokens/s and peak fraction of the rollout as it ran, with its seconds split into
  weight preparation (LoRA merge, fusing, prepacking), prefill, decode steps, sampling, other;
- `matmul_bound`: the peak fraction if every prefill and decode step cost only its matrix
  products (no attention, no elementwise ops, no sampling, no Python): no decoder can beat it;
- `decode_steps_vs_their_matmuls`: the decode steps' measured seconds ÷ their matmul-only
  seconds, i.e. what everything around the products costs, on the steps the rollout really ran.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter


class TimedStepper:
    """Wraps a stepper; records (kind, rows, seconds) of every prefill and decode step."""

    def __init__(self, stepper, log: list):
        self.stepper, self.log, self.name = stepper, log, stepper.name

    def _timed(self, kind, rows, call, *args):
        started = time.perf_counter()
        out = call(*args)
        self.log.append((kind, rows, time.perf_counter() - started))
        return out

    def prefill(self, prompts, pad_id, group_size, max_new_tokens, shared=None):
        # The rows a prefill's products need: the shared prefix once, every prompt's padded
        # suffix (the prefill runs them in tiles of 128 rows; the ideal counts the rows).
        from grpogate.engines.rows import WIDTH_BUCKET, round_up, shared_prefix_length

        shared = (shared_prefix_length(prompts) if shared is None
                  else min(shared, shared_prefix_length(prompts)))
        width = round_up(max(len(p) - shared for p in prompts), WIDTH_BUCKET)
        return self._timed("prefill", (shared, len(prompts) * width), self.stepper.prefill,
                           prompts, pad_id, group_size, max_new_tokens, shared)

    def step(self, token_ids):
        return self._timed("step", len(token_ids), self.stepper.step, token_ids)

    def select(self, keep):
        return self._timed("select", len(keep), self.stepper.select, keep)


def matmul_seconds(shapes, rows: int, dtype, packed: bool, cache: dict) -> float:
    """Seconds of one pass over every linear map at `rows` rows (best of a few rounds)."""
    import decode_ideal

    if rows not in cache:
        cache[rows] = decode_ideal.decode_step_tokens_per_second(
            shapes, rows, dtype, round_seconds=0.3, rounds=3, packed=packed)["seconds_per_decode_step"]
    return cache[rows]


def main() -> None:
    import torch

    import decode_ideal  # bench/ is sys.path[0] when this script runs
    from decode_paths import add_workload_arguments, load_workload
    from grpogate.sampling import rollout as rollout_module
    from grpogate.engines import engine_for
    from grpogate.inputs.policy import sampling_weights
    from grpogate.sampling.rollout import generate_completions

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    args = parser.parse_args()
    policy, prompts, settings, load_dir = load_workload(args)

    sample = rollout_module._sample
    log: list = []

    def timed_sample(logits, *rest, **keywords):
        started = time.perf_counter()
        chosen = sample(logits, *rest, **keywords)
        log.append(("sample", len(logits), time.perf_counter() - started))
        return chosen

    rollout_module._sample = timed_sample  # this script only: the rollout code is not changed

    def rollout(batch, seed):
        log.clear()
        started = time.perf_counter()  # as the evidence's rollout seconds: merge included
        with sampling_weights(policy):
            stepper = engine_for(policy.model).stepper(policy.model)
            log.append(("prepare", None, time.perf_counter() - started))
            completions = generate_completions(policy.model, policy.tokenizer, batch,
                                               args.group_size, settings, seed=seed,
                                               stepper=TimedStepper(stepper, log))
        seconds = time.perf_counter() - started
        return sum(len(c.completion_token_ids) for c in completions), seconds, list(log), stepper.name

    rollout(prompts[:args.prompts], 0)  # warm-up: kernel creation for the decoder's shapes
    runs = [rollout(prompts[(i + 1) * args.prompts:(i + 2) * args.prompts], i + 1)
            for i in range(args.rounds)]

    ideal = decode_ideal.measure_ideal(load_dir, args.prompts * args.group_size, args.threads)
    shapes = decode_ideal.linear_shapes(load_dir)
    dtype = getattr(torch, ideal["dtype"])
    packed = ideal.get("kernel") == "oneDNN prepacked"
    cache: dict = {}

    def bound_of(entries) -> tuple[float, float, float]:
        """(matmul-only seconds of prefill + steps, of the steps alone, measured step seconds)"""
        prefill = steps = measured_steps = 0.0
        for kind, rows, seconds in entries:
            if kind == "prefill":
                shared, suffix_rows = rows
                prefill += matmul_seconds(shapes, suffix_rows, dtype, packed, cache)
                prefill += matmul_seconds(shapes, shared, dtype, packed, cache) if shared else 0.0
            elif kind == "step":
                steps += matmul_seconds(shapes, rows, dtype, packed, cache)
                measured_steps += seconds
        return prefill + steps, steps, measured_steps

    ideal_rate = ideal["tokens_per_second"]
    rounds, totals = [], Counter()
    for tokens, seconds, entries, path in runs:
        bound_seconds, step_matmuls, step_seconds = bound_of(entries)
        split = Counter()
        for kind, _, spent in entries:
            split[kind] += spent
        split["other"] = seconds - sum(split.values())
        rounds.append({
            "decode_path": path, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_second": round(tokens / seconds, 1),
            "peak_fraction": round(tokens / seconds / ideal_rate, 3),
            "seconds_by_part": {k: round(v, 3) for k, v in split.items()},
            "decode_step_rows": sorted(Counter(r for k, r, _ in entries if k == "step").items(),
                                       reverse=True),
            "matmul_bound_peak_fraction": round(tokens / bound_seconds / ideal_rate, 3),
            "decode_steps_vs_their_matmuls": round(step_seconds / step_matmuls, 3),
        })
        totals.update({"tokens": tokens, "seconds": seconds, "bound": bound_seconds,
                       "step_matmuls": step_matmuls, "step_seconds": step_seconds})
    print(json.dumps({
        "ideal": {"tokens_per_second": round(ideal_rate, 1), "dtype": ideal["dtype"],
                  "kernel": ideal.get("kernel"), "batch_size": ideal["batch_size"]},
        "matmul_seconds_by_rows": {rows: round(s, 5) for rows, s in sorted(cache.items())},
        "rounds": rounds,
        "total": {
            "tokens_per_second": round(totals["tokens"] / totals["seconds"], 1),
            "peak_fraction": round(totals["tokens"] / totals["seconds"] / ideal_rate, 3),
            "matmul_bound_peak_fraction": round(totals["tokens"] / totals["bound"] / ideal_rate, 3),
            "decode_steps_vs_their_matmuls": round(totals["step_seconds"] / totals["step_matmuls"], 3),
        },
    }, indent=2))


if __name__ == "__main__":
    main()
