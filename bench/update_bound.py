"""How close the update gets to this machine's matmul ideal, on a recorded rollout of the default
workload, per layout of its micro-batches, A against B in one process.

    python bench/update_bound.py [--run-dir RUN] [--steps 4] [--rounds 2] [--layouts auto,padded,packed]
                                 [--prompts 8] [--group-size 8] [--max-new-tokens 48] [--json FILE]

The rollout: with `--run-dir`, the steps of a finished run (its prompts from problems.jsonl, its
completions re-encoded and cut or EOS-padded to their recorded token counts, its rewards, so the
same groups are valid); without, `--steps` rollouts sampled here at the default settings. Each
step's valid groups become the update batch `grpogate run` would build, and `grpo_update` runs on
it at the default settings (beta 0.02: reference, policy forward and backward) once per layout
per round, rotating which goes first, the adapter and optimizer restored between calls.

Counted from the real token counts (linear maps only; attention is not a matmul of the ideal):
- useful FLOPs: each valid group's prompt once and every completion token, through every linear
  map (the LM head only where a completion token is predicted), times the passes the update
  needs: reference forward (beta > 0), policy forward, and the backward's input gradient (the
  frozen base weights need no weight gradient; LoRA's is small and not counted);
- executed FLOPs: the same over the positions and logits the layout really computed;
- ideal seconds: the useful work's matrix products alone (forward x W^T and input-gradient x W
  per micro-batch), timed here with random weights of the model's shapes in every fast dtype
  the CPU has, with F.linear and on weights prepacked for oneDNN, best of a few rounds, the
  fastest kernel kept (so a faster kernel in the update could never flatter the fraction).
`update_useful_peak_fraction` = ideal seconds / update seconds (= useful FLOP/s over the ideal's
FLOP/s); `update_padding_fraction` = the executed FLOPs' share spent on padding positions and
padding logits. A layout that shares the prompts' common prefix across groups executes less
than the useful work: that saving shows as a higher peak fraction.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def checked_record(record, number: int, where: str, max_tokens: int, prompt_ids) -> tuple[int, str]:
    """(completion_tokens, prompt_id) of record `number` of a run directory's file `where`.
    A run directory is untrusted and its lengths set a bench script's work, so a length outside
    0..max_tokens or a prompt outside the run's set is refused with one error line."""
    if not isinstance(record, dict):
        raise SystemExit(f"error: {where}: record {number}: not a JSON object")
    tokens, prompt = record.get("completion_tokens"), record.get("prompt_id")
    if type(tokens) is not int or not 0 <= tokens <= max_tokens:
        raise SystemExit(f"error: {where}: record {number}: field completion_tokens "
                         f"{repr(tokens)[:40]} is not an integer in 0..{max_tokens}")
    if not isinstance(prompt, str) or prompt not in prompt_ids:
        raise SystemExit(f"error: {where}: record {number}: field prompt_id "
                         f"{repr(prompt)[:40]} is not a prompt of the run's set")
    return tokens, prompt


def recorded_rollouts(run_dir: str, tokenizer, system_prompt: str, max_prompt_tokens: int,
                      eos: int, steps: int, max_tokens: int) -> list[tuple[list, list, list]]:
    """[(prompt ids per sequence, completion ids, rewards)] per step of a finished run; each
    record checked (`checked_record`, lengths up to `max_tokens`; step an integer, reward a
    number, completion a string)."""
    from pathlib import Path

    from grpogate.files import read_jsonl
    from grpogate.inputs.tasks import problems_from_records
    from grpogate.sampling.rollout import encode_prompts

    problems_path = Path(run_dir) / "problems.jsonl"
    if problems_path.exists():
        train, _ = problems_from_records(list(enumerate(read_jsonl(problems_path), 1)),
                                         str(problems_path))
    else:  # a run from before problems.jsonl: its task regenerated from its own config
        train = _regenerated_train_set(Path(run_dir))
    prompts = dict(zip([p.prompt_id for p in train],
                       encode_prompts(tokenizer, train, system_prompt, max_prompt_tokens)))
    by_step: dict[int, list[dict]] = {}
    where = str(Path(run_dir) / "trajectories.jsonl")
    for number, record in enumerate(read_jsonl(Path(run_dir) / "trajectories.jsonl"), 1):
        checked_record(record, number, where, max_tokens, prompts)
        for field, kinds in (("step", (int,)), ("round", (int,)), ("sample_index", (int,)),
                             ("reward", (int, float)), ("completion", (str,))):
            value = record.get(field, 0 if field == "round" else None)
            if type(value) not in kinds:
                raise SystemExit(f"error: {where}: record {number}: field {field} "
                                 f"{repr(value)[:40]} is not {' or '.join(k.__name__ for k in kinds)}")
        by_step.setdefault(record["step"], []).append(record)
    rollouts = []
    for step in sorted(by_step)[:steps or None]:
        records = sorted(by_step[step], key=lambda r: (r.get("round", 0), r["prompt_id"], r["sample_index"]))
        completions = []
        for record in records:
            ids = tokenizer.encode(record["completion"], add_special_tokens=False)
            length = record["completion_tokens"]
            completions.append((ids + [eos] * length)[:length])  # the recorded length exactly
        rollouts.append(([prompts[r["prompt_id"]] for r in records], completions,
                         [float(r["reward"]) for r in records]))
    return rollouts


def _regenerated_train_set(run_dir):
    """The train problems of a run without problems.jsonl: its task, sizes and seed as its
    evidence records them (prompt ids are question hashes, so a mismatch cannot pass)."""
    from grpogate.admission import load_problem_sets
    from grpogate.config import load_config
    from grpogate.files import read_json

    recorded = read_json(run_dir / "evidence.json")["config"]  # bounded and strict: untrusted
    task = recorded["task"]
    overrides = [f"task.{key}={json.dumps(value)}" for key, value in task.items()
                 if key != "params" and isinstance(value, (str, int, float, bool))]
    overrides += [f"task.params.{key}={json.dumps(value)}"
                  for key, value in (task.get("params") or {}).items()]
    config = load_config("default", overrides=overrides, train_prompts=recorded["train_prompts"],
                         prompts_per_step=recorded["prompts_per_step"],
                         eval_prompts=recorded["eval_prompts"], seed=recorded["seed"])
    train, _, _, _ = load_problem_sets(config)
    return train


def sampled_rollouts(policy, config, steps: int) -> list[tuple[list, list, list]]:
    from grpogate.inputs.policy import sampling_weights
    from grpogate.inputs.verifiers import get_verifier
    from grpogate.admission import load_problem_sets
    from grpogate.engines import engine_for
    from grpogate.sampling.rollout import encode_prompts, generate_completions, sampling_settings

    train, _, _, _ = load_problem_sets(config)
    verifier = get_verifier(config.resolved_verifier())
    prompts = encode_prompts(policy.tokenizer, train, config.resolved_system_prompt(),
                             config.max_prompt_tokens)
    rollouts = []
    for step in range(steps):
        indexes = range(step * config.prompts_per_step, (step + 1) * config.prompts_per_step)
        with sampling_weights(policy):
            completions = generate_completions(
                policy.model, policy.tokenizer, [prompts[i] for i in indexes], config.group_size,
                sampling_settings(config), config.seed + step, stepper=engine_for(policy.model).stepper(policy.model))
        rewards = [verifier.score(c.text, train[indexes[c.prompt_index]].reference) for c in completions]
        rollouts.append(([c.prompt_token_ids for c in completions],
                         [c.completion_token_ids for c in completions], rewards))
    return rollouts


def work_counts(batch, settings, shape, layout: str, pad_id: int) -> dict:
    """(positions, logits) of one forward over every micro-batch: useful (each group's prompt
    once, every completion token), executed (padding included) and the real ones among the
    executed; and each micro-batch's useful counts, the ideal's shapes."""
    import torch

    from grpogate.training.batching import micro_batches, pack_rows, rows_per_prompt
    from grpogate.training.logprobs import PackedRow

    useful, executed, real, micros = [0, 0], [0, 0], [0, 0], []
    rows = list(range(len(batch)))
    for micro in micro_batches(batch, rows, settings.micro_batch_size):
        per_prompt = rows_per_prompt(batch, micro)
        completions = [batch.completion_token_ids[i] for i in micro]
        prompts = [batch.prompt_token_ids[i] for i in micro[::per_prompt]]
        positions = sum(map(len, prompts)) + sum(max(len(c) - 1, 0) for c in completions)
        logits = sum(map(len, completions))
        micros.append((positions, logits))
        useful[0] += positions
        useful[1] += logits
        packed = pack_rows(batch, micro, pad_id, torch.device("cpu"), layout, shape)
        forwarded, forwarded_real = packed.forwarded_tokens()
        executed[0] += forwarded
        real[0] += forwarded_real
        if isinstance(packed, PackedRow):  # a logit per distinct predicting position
            executed[1] += len(packed.logit_positions)
            real[1] += len(packed.logit_positions)
        else:  # every [N, T] position, padding included
            executed[1] += packed.completion_ids.numel()
            real[1] += logits
    return {"useful": useful, "executed": executed, "executed_real": real, "micro_batches": micros}


def linear_shapes(model_config) -> list[tuple[int, int]]:
    """(in, out) of every linear map, the LM head last: the model rebuilt on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def flops(counts: list[int], shape, passes: int) -> float:
    """2 x multiply-adds of the linear maps over (positions, logits), `passes` times."""
    positions, logits = counts
    return 2.0 * passes * (positions * shape.per_token + logits * shape.per_logit)


def ideal_seconds(linear_shapes, micro_batches: list[tuple[int, int]], passes: int,
                  rounds: int = 3, dtypes: list | None = None) -> dict:
    """The useful work's matrix products alone, per fast dtype (or per one of `dtypes`): per
    micro-batch, every linear map on its positions (the LM head on its logits), as x W^T
    (forwards) and g W (input gradient), `passes` - 1 forwards and one input gradient. Best
    round counts."""
    import torch

    from grpogate.engines.cpu.weights import bf16_kernels_available, linear

    if dtypes is None:
        dtypes = [torch.float32] + ([torch.bfloat16] if bf16_kernels_available() else [])
    generator = torch.Generator().manual_seed(0)
    measured = {}
    for dtype, packed in [(d, p) for d in dtypes for p in (False, True)]:
        if packed and not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            continue
        weights = [(torch.randn(out, inp, generator=generator) * 0.02).to(dtype)
                   for inp, out in linear_shapes]
        head = len(weights) - 1  # the LM head is the model's last linear map
        # One buffer per map at the most rows any micro-batch has; a micro-batch reads its
        # leading rows (a contiguous view), so a whole run's shapes fit in memory.
        most = max(max(rows, logits) for rows, logits in micro_batches)
        buffers = [(torch.randn(most, w.shape[1]).to(dtype), torch.randn(most, w.shape[0]).to(dtype))
                   for w in weights]
        inputs = [(x[:n], g[:n]) for rows, logits in micro_batches
                  for i, (x, g) in enumerate(buffers) for n in [rows if i != head else logits]]
        # forward x W^T with W [out, in]; input gradient g W = linear(g, W^T), W^T [in, out]
        kernels = [(torch.ops.mkldnn._reorder_linear_weight(w),
                    torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous())) if packed
                   else (w, w.t().contiguous()) for w in weights]
        pairs = list(zip(kernels * len(micro_batches), inputs))
        best = float("inf")
        with torch.inference_mode():
            for _ in range(rounds + 1):  # the first round warms the kernels up
                started = time.perf_counter()
                for (forward, backward), (x, grad) in pairs:
                    for _ in range(passes - 1):
                        linear(x, forward, None)  # [rows, in] -> [rows, out]
                    linear(grad, backward, None)  # [rows, out] -> [rows, in]: input gradient
                best = min(best, time.perf_counter() - started)
        measured[f"{str(dtype).removeprefix('torch.')}{', oneDNN prepacked' if packed else ''}"] = best
    fastest = min(measured, key=measured.get)
    return {"seconds": measured[fastest], "kernel": fastest, "by_kernel": measured}


def time_updates(policy, config, batches, layouts: list[str], rounds: int) -> dict:
    """Seconds and record counts of `grpo_update` per layout, summed over the steps' batches;
    each layout's best round counts."""
    import dataclasses

    import torch

    from grpogate.inputs.policy import reference_mode, trainable_parameters
    from grpogate.training.update import TrainingSnapshot, UpdateSettings, grpo_update

    parameters = list(trainable_parameters(policy).values())
    base = UpdateSettings.from_config(config)
    results = {layout: {"seconds": [], "tokens": 0, "forwarded": 0, "forwarded_real": 0}
               for layout in layouts}
    for round_index in range(rounds + 1):  # round 0 warms every layout up on one step, not counted
        order = layouts[round_index % len(layouts):] + layouts[:round_index % len(layouts)]
        for layout in order:
            settings = dataclasses.replace(base, layout=layout)
            spent = 0.0
            for batch in (batches if round_index else batches[:1]):
                optimizer = torch.optim.AdamW(parameters, lr=config.learning_rate)
                snapshot = TrainingSnapshot.take(parameters, optimizer)
                started = time.perf_counter()
                record = grpo_update(policy.model, optimizer, batch, settings,
                                     policy.tokenizer.pad_token_id, lambda: reference_mode(policy),
                                     parameters)
                spent += time.perf_counter() - started
                snapshot.restore(parameters, optimizer)
                if round_index == 1:
                    results[layout]["tokens"] += record.tokens
                    results[layout]["forwarded"] += record.forwarded_tokens
                    results[layout]["forwarded_real"] += record.forwarded_real_tokens
            if round_index:
                results[layout]["seconds"].append(spent)
    return results


def format_table(report: dict) -> str:
    """The report as a printed table, one row per layout, the headline under it."""
    rollout, ideal = report["rollout"], report["ideal"]
    lines = [f"rollout: {rollout['source']}, {rollout['steps']} steps, {rollout['valid_groups']} valid "
             f"groups, {rollout['sequences']} sequences; {report['dtype']}, {report['passes']} passes",
             f"ideal: {ideal['seconds']:.2f} s ({ideal['kernel']})",
             "",
             f"{'layout':<8} {'update s':>9} {'useful TFLOP':>13} {'executed TFLOP':>15} "
             f"{'padding':>8} {'positions':>10} {'tokens/s':>9} {'peak fraction':>14}"]
    for name, row in report["layouts"].items():
        lines.append(f"{name:<8} {row['update_seconds']:>9.2f} {row['useful_tflop']:>13.4f} "
                     f"{row['executed_tflop']:>15.4f} {row['update_padding_fraction']:>8.3f} "
                     f"{row['tokens_forwarded']:>10} {row['update_tokens_per_second']:>9.1f} "
                     f"{row['update_useful_peak_fraction']:>14.3f}")
    lines += ["", f"update_useful_peak_fraction ({report['layout']}): "
                  f"{report['update_useful_peak_fraction']:.3f} = ideal {report['ideal_seconds']:.2f} s "
                  f"/ update {report['update_seconds']:.2f} s"]
    return "\n".join(lines)


def main() -> None:
    import torch

    from grpogate.config import load_config
    from grpogate.inputs.policy import load_policy
    from grpogate.training.advantages import build_update_batch
    from grpogate.training.batching import LAYOUTS, ForwardShape
    from grpogate.training.update import UpdateSettings

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default="", help="take the rollouts from this finished run")
    parser.add_argument("--steps", type=int, default=4, help="steps of the rollout (0: all of --run-dir's)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per layout")
    parser.add_argument("--layouts", default="auto,padded,packed", help=f"from {', '.join(LAYOUTS)}")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per sampled step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48,
                        help="the sampled rollout's budget; with --run-dir, the longest recorded "
                             "completion accepted (the run's max_new_tokens)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override (e.g. model=DIR for a small model)")
    parser.add_argument("--json", default="", help="also write the result here")
    args = parser.parse_args()
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    if not layouts or any(name not in LAYOUTS for name in layouts):
        parser.error(f"--layouts: choose from {', '.join(LAYOUTS)}")

    torch.set_num_threads(args.threads)
    config = load_config("default", overrides=args.set, prompts_per_step=args.prompts,
                         train_prompts=args.prompts * max(args.steps, 1),
                         group_size=args.group_size, max_new_tokens=args.max_new_tokens)
    policy = load_policy(config, seed=config.seed)
    policy.model.eval()  # as in a run, where the rollout's generate_completions sets it
    eos = policy.tokenizer.eos_token_id
    rollouts = (recorded_rollouts(args.run_dir, policy.tokenizer, config.resolved_system_prompt(),
                                  config.max_prompt_tokens, eos, args.steps, config.max_new_tokens)
                if args.run_dir else sampled_rollouts(policy, config, args.steps))
    batches = [build_update_batch(p, c, r, config.group_size) for p, c, r in rollouts]
    batches = [b for b in batches if len(b)]
    if not batches:
        raise SystemExit("no valid group in the rollout: nothing to update")
    shape = ForwardShape.of(policy.model.config)
    # reference (beta > 0) + policy forward + the backward's input gradient (a forward's cost)
    passes = 3 if config.beta > 0 else 2
    timed = time_updates(policy, config, batches, layouts, args.rounds)
    settings = UpdateSettings.from_config(config)
    micros = [m for b in batches  # the useful shapes do not depend on the layout
              for m in work_counts(b, settings, shape, "padded", eos)["micro_batches"]]
    ideal = ideal_seconds(linear_shapes(policy.model.config), micros, passes)
    report = {"rollout": {"source": args.run_dir or "sampled", "steps": len(batches),
                          "valid_groups": sum(b.group_count for b in batches),
                          "sequences": sum(len(b) for b in batches)},
              "dtype": str(next(policy.model.parameters()).dtype).removeprefix("torch."),
              "passes": passes, "ideal": ideal, "layouts": {}}
    for layout in layouts:
        counts = [work_counts(b, settings, shape, layout, eos) for b in batches]
        useful = flops([sum(c["useful"][k] for c in counts) for k in (0, 1)], shape, passes)
        executed = flops([sum(c["executed"][k] for c in counts) for k in (0, 1)], shape, passes)
        real = flops([sum(c["executed_real"][k] for c in counts) for k in (0, 1)], shape, passes)
        seconds = min(timed[layout]["seconds"])
        report["layouts"][layout] = {
            "update_seconds": round(seconds, 3),
            "update_seconds_by_round": [round(s, 3) for s in timed[layout]["seconds"]],
            "useful_tflop": round(useful / 1e12, 4), "executed_tflop": round(executed / 1e12, 4),
            "update_padding_fraction": round(1 - real / executed, 4),
            "update_useful_peak_fraction": round(ideal["seconds"] / seconds, 4),
            "tokens_trained": timed[layout]["tokens"], "tokens_forwarded": timed[layout]["forwarded"],
            "tokens_forwarded_real": timed[layout]["forwarded_real"],
            "update_tokens_per_second": round(timed[layout]["tokens"] / seconds, 1)}
    headline = report["layouts"][layouts[0]]  # the first layout named: by default what runs use
    report.update({"layout": layouts[0], "update_seconds": headline["update_seconds"],
                   "ideal_seconds": round(ideal["seconds"], 3),
                   "update_useful_peak_fraction": headline["update_useful_peak_fraction"],
                   "update_padding_fraction": headline["update_padding_fraction"]})
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    from grpogate.errors import InputError, visible

    try:
        main()
    except InputError as error:  # a run directory's bad file: one line, no traceback
        raise SystemExit(f"error: {visible(error)}") from None
