"""A finished run against this machine's matrix products: what each stage would cost if it did
nothing but its linear maps.

    python bench/workload_bound.py --run-dir RUN [--json FILE]

From the run's own records (problems.jsonl, trajectories.jsonl, eval_completions.jsonl,
guard_completions.jsonl, evidence.json) it counts the rows every linear map had to see, times
those products here with random weights of the model's shapes in the dtype this machine loads
the model in (the faster of F.linear and oneDNN's prepacked kernel at each row count, best of a
few rounds), and prints each stage's seconds as the run recorded them beside its products-only
seconds:

- rollout: each generation batch (the prompts `generate_completions` decodes together) costs a
  prefill — the prompt set's shared prefix once, every prompt's own tokens, the LM head once per
  prompt — and one decode step per token position over the rows still running: a completion of
  L tokens is fed to L - 1 steps (its first token comes from the prefill's logits);
- update: `update_bound.ideal_seconds` over the run's valid groups (reference forward when
  beta > 0, the policy's forward, the input gradient);
- re-test: the same accounting for the baseline's and the candidate's completions on the eval
  set and the guard set, plus the candidate's completions once more through the baseline (the
  drift's KL is read from the baseline's logits on them);
- load and checkpoints compute no products: shown as recorded.

Attention, norms, sampling, Python and file work are not products, so no implementation of the
same stages can beat the bound. Between the row counts it times (every 8 up to 64, every 16 up
to 256) a step's products are interpolated linearly; above 256 rows the per-row cost at 256
is used (the kernels are saturated there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

GRID = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16))


class Products:
    """Seconds of the model's linear maps at a row count, the layers' and the LM head's apart."""

    def __init__(self, shapes: list[tuple[int, int]], dtype, rounds: int = 3):
        import torch

        from grpogate.engines.cpu.weights import can_prepack, prepack

        generator = torch.Generator().manual_seed(0)
        weights = [(torch.randn(out, inp, generator=generator) * 0.02).to(dtype) for inp, out in shapes]
        kernels = [weights] + ([[prepack(w) for w in weights]] if can_prepack(weights[0]) else [])
        self.parts = {"layers": [k[:-1] for k in kernels], "head": [k[-1:] for k in kernels]}
        self.inputs = {inp: torch.randn(GRID[-1], inp, generator=generator).to(dtype)
                       for inp, _ in shapes}
        self.rounds, self.timed = rounds, {}

    def _time(self, part: str, rows: int) -> float:
        import torch

        from grpogate.engines.cpu.weights import linear

        if (part, rows) not in self.timed:
            best = float("inf")
            with torch.inference_mode():
                for weights in self.parts[part]:  # the faster kernel counts
                    pairs = [(self.inputs[w.shape[1]][:rows], w) for w in weights]
                    for round_index in range(self.rounds + 1):  # round 0 warms the kernels
                        started = time.perf_counter()
                        for x, w in pairs:
                            linear(x, w, None)
                        if round_index:
                            best = min(best, time.perf_counter() - started)
            self.timed[(part, rows)] = best
        return self.timed[(part, rows)]

    def seconds(self, part: str, rows: int) -> float:
        """Interpolated between the grid's timed row counts; per-row beyond the last."""
        if rows <= 0:
            return 0.0
        if rows >= GRID[-1]:
            return self._time(part, GRID[-1]) * rows / GRID[-1]
        upper = next(i for i, g in enumerate(GRID) if g >= rows)
        if GRID[upper] == rows:  # rows 1 is GRID[0]
            return self._time(part, GRID[upper]) * rows / GRID[upper]
        low, high = GRID[upper - 1], GRID[upper]
        share = (rows - low) / (high - low)
        return (1 - share) * self._time(part, low) + share * self._time(part, high)

    def step(self, rows: int, head_rows: int | None = None) -> float:
        return self.seconds("layers", rows) + self.seconds("head", rows if head_rows is None else head_rows)


def generation_seconds(products: Products, prompts: list[list[int]], lengths: list[list[int]],
                       group_size: int, batch_rows: int, shared: int) -> float:
    """Products-only seconds of sampling `lengths[j]` (G completion lengths) for every prompt j,
    in batches of batch_rows // G prompts as `generate_completions` forms them."""
    per_batch = max(1, batch_rows // group_size)
    total = 0.0
    for start in range(0, len(prompts), per_batch):
        batch = range(start, min(start + per_batch, len(prompts)))
        own = sum(len(prompts[j]) - shared for j in batch)
        total += products.seconds("layers", shared) + products.step(own, head_rows=len(batch))
        rows = [length for j in batch for length in lengths[j]]
        for position in range(1, max(rows, default=0)):
            total += products.step(sum(1 for length in rows if length > position))
    return total


def grouped(records: list[dict], key, where: str, max_tokens: int, prompt_ids) -> dict:
    """records -> {key: {prompt_id: [completion lengths]}} in first-seen prompt order, each
    record checked by `update_bound.checked_record` (the run directory is untrusted)."""
    from update_bound import checked_record  # bench/ is sys.path[0] when this script runs

    out: dict = {}
    for number, record in enumerate(records, 1):
        tokens, prompt = checked_record(record, number, where, max_tokens, prompt_ids)
        out.setdefault(key(record), {}).setdefault(prompt, []).append(tokens)
    return out


def main() -> None:
    import torch

    import update_bound  # bench/ is sys.path[0] when this script runs
    from grpogate.config import resume_config
    from grpogate.files import read_json, read_jsonl
    from grpogate.inputs.policy import load_policy
    from grpogate.inputs.tasks import stored_sets
    from grpogate.review.replay import refuse_sources_inside
    from grpogate.engines.rows import shared_prefix_length
    from grpogate.sampling.rollout import encode_prompts
    from grpogate.training.advantages import build_update_batch
    from grpogate.training.batching import ForwardShape
    from grpogate.training.update import UpdateSettings

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, help="a finished run's directory")
    parser.add_argument("--model", default="",
                        help="load this model instead of the run's (same shapes; a test uses a tiny one)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--json", default="", help="also write the result here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run = Path(args.run_dir)
    evidence = read_json(run / "evidence.json")  # bounded and strict: the run directory is untrusted
    config = resume_config(evidence.get("config") if isinstance(evidence, dict) else None,
                           str(run / "evidence.json"))
    if args.model:
        config = dataclasses.replace(config, model=args.model)
    refuse_sources_inside(config, run)
    policy = load_policy(config, seed=config.seed)
    dtype = next(policy.model.parameters()).dtype
    problems_path = run / "problems.jsonl"
    sets = stored_sets(list(enumerate(read_jsonl(problems_path), 1)), str(problems_path))
    encoded = {name: dict(zip([p.prompt_id for p in problems],
                              encode_prompts(policy.tokenizer, problems,
                                             config.resolved_system_prompt(),
                                             config.max_prompt_tokens)))
               for name, problems in sets.items() if problems}
    shared = {name: shared_prefix_length(list(prompts.values())) for name, prompts in encoded.items()}
    shapes = update_bound.linear_shapes(policy.model.config)
    products = Products(shapes, dtype)
    batch_rows = config.generation_batch_size

    def sampled(split: str, by_prompt: dict, group_size: int) -> float:
        return generation_seconds(products, [encoded[split][p] for p in by_prompt],
                                  list(by_prompt.values()), group_size, batch_rows, shared[split])

    def lengths(name: str, split: str, key) -> dict:
        records = read_jsonl(run / name)
        return grouped(records, key, str(run / name), config.max_new_tokens,
                       encoded.get(split, {})), records

    steps, _ = lengths("trajectories.jsonl", "train", lambda r: (r.get("step"), r.get("round", 0)))
    rollout = sum(sampled("train", by_prompt, config.group_size) for by_prompt in steps.values())
    retest = {}
    for split, name, group_size in (("eval", "eval_completions.jsonl", config.eval_group_size),
                                    ("guard", "guard_completions.jsonl", config.guard.group_size)):
        if (run / name).exists() and split in encoded:
            by_policy, records = lengths(name, split, lambda r: str(r.get("policy")))
            retest[split] = {policy_name: sampled(split, by_prompt, group_size)
                             for policy_name, by_prompt in by_policy.items()}
            if split == "eval" and "candidate" in retest[split] and any(
                    "kl_to_baseline" in r for r in records):
                # the drift: the candidate's completions through the baseline as well
                retest[split]["baseline on the candidate's"] = retest[split]["candidate"]

    eos = policy.tokenizer.eos_token_id
    rollouts = update_bound.recorded_rollouts(str(run), policy.tokenizer,
                                              config.resolved_system_prompt(),
                                              config.max_prompt_tokens, eos, 0,
                                              config.max_new_tokens)
    batches = [b for b in (build_update_batch(p, c, r, config.group_size) for p, c, r in rollouts)
               if len(b)]
    settings, shape = UpdateSettings.from_config(config), ForwardShape.of(policy.model.config)
    micros = [m for b in batches
              for m in update_bound.work_counts(b, settings, shape, "padded", eos)["micro_batches"]]
    passes = 3 if config.beta > 0 else 2
    update = update_bound.ideal_seconds(shapes, micros, passes, dtypes=[dtype])["seconds"] if micros else 0.0

    recorded = evidence["timings"]
    stages = {
        "load": (recorded.get("load_seconds", 0.0), 0.0),
        "rollout": (recorded.get("rollout_seconds", 0.0), rollout),
        "update": (recorded.get("update_seconds", 0.0), update),
        "re-test": (recorded.get("evaluation_seconds", 0.0),
                    sum(s for by_policy in retest.values() for s in by_policy.values())),
        "checkpoints": (recorded.get("checkpoint_seconds", 0.0), 0.0),
    }
    total = (recorded.get("total_seconds", 0.0), sum(bound for _, bound in stages.values()))
    report = {
        "run_dir": str(run), "dtype": str(dtype).removeprefix("torch."),
        "stages": {name: {"recorded_seconds": round(seconds, 2), "products_seconds": round(bound, 2)}
                   for name, (seconds, bound) in stages.items()},
        "re-test_products_by_pass": {split: {k: round(v, 2) for k, v in by_policy.items()}
                                     for split, by_policy in retest.items()},
        "total": {"recorded_seconds": round(total[0], 2),
                  "products_seconds": round(total[1], 2),
                  "products_plus_load_and_checkpoints": round(
                      total[1] + stages["load"][0] + stages["checkpoints"][0], 2)},
        "products_seconds_by_rows": {f"{part} {rows}": round(s, 5)
                                     for (part, rows), s in sorted(products.timed.items())},
    }
    print(f"{'stage':<12} {'recorded s':>11} {'products-only s':>16}")
    for name, row in report["stages"].items():
        print(f"{name:<12} {row['recorded_seconds']:>11.2f} {row['products_seconds']:>16.2f}")
    print(f"{'total':<12} {total[0]:>11.2f} {total[1]:>16.2f}  "
          f"(with load and checkpoints as recorded: "
          f"{report['total']['products_plus_load_and_checkpoints']:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    from grpogate.errors import InputError, visible

    try:
        main()
    except InputError as error:  # a run directory's bad file: one line, no traceback
        raise SystemExit(f"error: {visible(error)}") from None
