"""Generation tokens/s of grpogate's decode paths, A against B in one process.

    python bench/decode_paths.py [--rounds 3] [--paths lean,lean-plain,model] [--prompts 8] ...

Paths: `lean` (decoding.LeanStepper, weights prepacked where the CPU allows, the native kernels
where they build), `lean-unpacked` (the same without prepacking), `lean-torch` (`lean` with
torch's operations around the products), `lean-plain` (that without prepacking) and `model`
(decoding.ModelStepper, the model's own forward), on the benchmark's rollout workload: the
bundled SmolLM2, chain_sum train prompts, G = 8, temperature 1.0, the merged-LoRA sampling
weights, the run's dtype. Each round samples the same prompts with
every path, rotating which goes first, so machine noise falls on all; the decode ideal at the
same batch (decode_ideal.py) is timed in the same process. Prints JSON: tokens/s per path and
round, the totals, each path ÷ the last one and each path's peak fraction.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The rollout workload's flags: rounds of `prompts` x `group_size`, token budget, threads."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))


def load_workload(args):
    """(policy, encoded train prompts for rounds + 1 rollouts, sampling settings, model dir).

    The bench's rollout workload: bundled SmolLM2, chain_sum train prompts, temperature 1.0.
    """
    import torch

    from grpogate.config import load_config
    from grpogate.admission import load_problem_sets
    from grpogate.sampling.rollout import sampling_settings
    from grpogate.inputs.policy import default_cache_dir, load_policy, resolve_base_model
    from grpogate.sampling.rollout import encode_prompts

    torch.set_num_threads(args.threads)
    config = load_config("default", train_prompts=args.prompts * (args.rounds + 1),
                         prompts_per_step=args.prompts, group_size=args.group_size,
                         max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0)
    train, _, _, _ = load_problem_sets(config)
    policy = load_policy(config, seed=config.seed)
    prompts = encode_prompts(policy.tokenizer, train, config.resolved_system_prompt(),
                             config.max_prompt_tokens)
    load_dir = resolve_base_model(config.model, "", default_cache_dir(config)).load_dir
    return policy, prompts, sampling_settings(config), load_dir


PATHS = {"lean": {"lean": True, "pack": True},
         "lean-unpacked": {"lean": True, "pack": False},
         "lean-torch": {"lean": True, "pack": True, "native": False},
         "lean-plain": {"lean": True, "pack": False, "native": False},
         "model": {"lean": False}}


def main() -> None:
    import decode_ideal  # bench/ is sys.path[0] when this script runs
    from grpogate.engines.cpu import CpuEngine
    from grpogate.inputs.policy import sampling_weights
    from grpogate.sampling.rollout import generate_completions

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default="lean,lean-plain,model",
                        help="comma-separated, from: " + ", ".join(PATHS))
    add_workload_arguments(parser)
    args = parser.parse_args()
    policy, prompts, settings, load_dir = load_workload(args)

    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or any(p not in PATHS for p in paths):
        parser.error(f"--paths: choose from {', '.join(PATHS)}")

    def rollout(batch, path: str, seed: int) -> tuple[int, float]:
        with sampling_weights(policy):
            started = time.perf_counter()  # the stepper (fusing, prepacking) is rollout time
            completions = generate_completions(policy.model, policy.tokenizer, batch,
                                               args.group_size, settings, seed=seed,
                                               stepper=CpuEngine(**PATHS[path]).stepper(policy.model))
            seconds = time.perf_counter() - started
        return sum(len(c.completion_token_ids) for c in completions), seconds

    for path in paths:  # warm-up: kernel creation for every path's shapes
        rollout(prompts[:args.prompts], path, 0)
    rounds, totals = [], {path: [0, 0.0] for path in paths}
    for index in range(args.rounds):
        batch = prompts[(index + 1) * args.prompts:(index + 2) * args.prompts]
        order = paths[index % len(paths):] + paths[:index % len(paths)]
        measured = {}
        for path in order:
            tokens, seconds = rollout(batch, path, seed=index + 1)
            measured[path] = round(tokens / seconds, 1)
            totals[path][0] += tokens
            totals[path][1] += seconds
        rounds.append(measured)
    ideal = decode_ideal.measure_ideal(load_dir, args.prompts * args.group_size, args.threads)
    rate = {path: tokens / seconds for path, (tokens, seconds) in totals.items()}
    print(json.dumps({
        "dtype": str(next(policy.model.parameters()).dtype).removeprefix("torch."),
        "batch": args.prompts * args.group_size, "rounds": rounds,
        "tokens_per_second": {p: round(r, 1) for p, r in rate.items()},
        f"over_{paths[-1]}": {p: round(r / rate[paths[-1]], 3) for p, r in rate.items()},
        "ideal_tokens_per_second": round(ideal["tokens_per_second"], 1),
        "peak_fraction": {p: round(r / ideal["tokens_per_second"], 3) for p, r in rate.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
