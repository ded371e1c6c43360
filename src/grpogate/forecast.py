"""What a run will take on this machine, forecast by the dry run: its wall seconds.

The dry run times this machine's matrix products for the model's shapes (`measure_rates`:
weights of the config's shapes in the run's dtype on the run's device, through the kernels the
decoder uses; about a second) and counts the products the run's stages will ask for
(`workload_seconds`: pure arithmetic over the config and the prompts' token counts):

- rollout: per training step, each generation batch's prefill (every prompt's tokens once) and
  max_new_tokens - 1 decode steps; a decode step costs a part that reads every weight once
  whatever the rows (`step_fixed`) and a part per row still decoding (`step_per_row`);
- update: reference forward when beta > 0, then per iteration the policy's forward and its
  input gradient (about a forward's products each), over the trained groups' tokens;
- re-test: per look, the baseline's and the candidate's decodes of the look's eval prompts
  (and the baseline in lockstep with the candidate, for the drift's KL), and the guard rounds'
  two decodes;
- load, checkpoints and start-up: passes over the weights' bytes, over each step's checkpoint's
  bytes, and the interpreter's imports (timed: this process paid them too).

Each stage's products are divided by the share of its wall time they take
(`STAGE_PRODUCT_SHARE`), and the rollout and update add a part per step that no token count
moves (`STEP_WEIGHT_PASSES`). The expected figure counts completions of
`PLANNING["completion_fraction"]` of max_new_tokens, that share of valid groups, and the
re-test stopping where the planning gains are resolved with probability one half
(`expected_retest`); the upper figure counts every completion to max_new_tokens, every group
valid, the re-test at its maximum (stopping.plan's most completions), and every stage
`UPPER_SLOWDOWN` slower. The counts and shares were fitted on the CPU accelerator; under the
reference engine (a model the accelerator declines, or CUDA) they are the same arithmetic on
that device's measured products, not a fit.
"""

from __future__ import annotations

import hashlib
import os
import time

from grpogate.config import RunConfig
from grpogate.evidence import stopping

# The default's own run at seed 42 (docs/measurements.md, "The sequential re-test on the
# default"): completions averaged 13.2 of 48 tokens, 199 of 512 groups were valid, and the
# re-test measured gains of +0.28 (reward), +0.23 (pass@4) and +0.23 (guard). A finished run
# states its own.
PLANNING = {"completion_fraction": 0.28, "valid_group_fraction": 0.39,
            "gains": {"reward": 0.28, "pass_at_group": 0.23, "guard": 0.23}}
# Each stage's wall seconds: its products over the share of its time they take (attention,
# sampling, Python and the allocator make up the rest), plus, for the rollout and the update, a
# part per training step that no token count moves (the decoder's weights repacked for the
# step's rollout; the update's optimizer step, adapter merge and per-module work), in passes
# over the weights' bytes (`weight_pass`: the measured seconds to write them once). Fitted on
# the default and the smoke profile on the AMX class (docs/measurements.md, "The dry run's
# forecast").
STAGE_PRODUCT_SHARE = {"rollout": 0.85, "update": 0.3, "retest": 0.4}
STEP_WEIGHT_PASSES = {"rollout": 11.0, "update": 10.0}
UPPER_SLOWDOWN = 1.3  # the upper figure: every stage this much slower again
# Loading (the weights read from the cache, cast, wrapped by PEFT, probed, packed) and each
# step's checkpoint (adapter and AdamW's moments serialised, hashed, written, synced), in
# passes over their bytes: of a write (`weight_pass`), of the hash (`hash_per_byte`).
LOAD_WEIGHT_PASSES = 42.0
CHECKPOINT_HASH_PASSES = 7.0
# Besides the stages and the interpreter's imports: the problems generated and admitted, the
# report drawn (`FINISH_SECONDS`), and each completion's record written, audited and hashed.
FINISH_SECONDS = 2.0
RECORD_SECONDS = 0.001


def decode_seconds(rates: dict, steps: int, row_steps: float) -> float:
    """Products of `steps` decode steps that together feed `row_steps` rows."""
    return steps * rates["step_fixed"] + row_steps * rates["step_per_row"]


def decode_products(config: RunConfig, rates: dict, prompt: dict, prompts: int, group_size: int,
                    completion_fraction: float) -> float:
    """`prompts` x `group_size` completions in generation batches of whole groups: each batch's
    prefill (the shared prefix once, each prompt's own tokens once) and its decode steps, the
    rows thinning as completions end (`completion_fraction` of max_new_tokens on average)."""
    prompts_per_batch = max(1, config.generation_batch_size // group_size)
    steps = max(config.max_new_tokens - 1, 0)
    seconds = 0.0
    for start in range(0, prompts, prompts_per_batch):
        in_batch = min(prompts_per_batch, prompts - start)
        prefill = prompt["shared"] + in_batch * prompt["own"]
        seconds += prefill * rates["per_token"] + decode_seconds(
            rates, steps, in_batch * group_size * steps * completion_fraction)
    return seconds


def update_products(config: RunConfig, rates: dict, prompt: dict, completion_fraction: float,
                    valid_fraction: float) -> float:
    """One training step's update: its valid groups packed (the shared prefix once, each
    group's own prompt tokens once, every completion), forwarded by the reference when
    beta > 0, then forward and input gradient per iteration."""
    groups = config.prompts_per_step * valid_fraction
    tokens = (prompt["shared"] + groups * prompt["own"]
              + groups * config.group_size * config.max_new_tokens * completion_fraction)
    passes = (1 if config.beta > 0 else 0) + 2 * config.num_iterations
    return passes * tokens * rates["per_token"]


def expected_retest(config: RunConfig) -> dict:
    """The eval prompts and guard rounds the re-test samples, expected and at most: it is
    expected to stop at the first look at which the planning gains are resolved with
    probability one half (stopping.prompts_to_show at stopping.PLANNING_SPREADS, the planning
    stopping.plan states at probability 0.8). A resolvable gain only shrinks as observations
    grow, so both gain gates are resolved at the later of their two first looks."""
    design = stopping.design_of(config.to_dict())
    if design is None:
        return {"expected": (config.eval_prompts, 1), "most": (config.eval_prompts, 1)}
    margins = stopping.margins_of(config.to_dict()["gates"])

    def first(gate: str, batch: int, most: int) -> int | None:
        return stopping.prompts_to_show(stopping.PLANNING_SPREADS[gate], PLANNING["gains"][gate],
                                        margins[gate], batch, most, power=0.5)

    batch = max(1, design["eval_batch"])
    shown = [first(gate, batch, design["eval_max"]) for gate in ("reward", "pass_at_group")]
    eval_prompts = design["eval_max"] if None in shown else max(shown)
    rounds = design["guard_max"] // design["guard_batch"] if design["guard_batch"] else 0
    guard = first("guard", design["guard_batch"], rounds * design["guard_batch"])
    guard_rounds = rounds if guard is None else guard // design["guard_batch"]
    return {"expected": (eval_prompts, guard_rounds), "most": (design["eval_max"], rounds)}


def retest_products(config: RunConfig, rates: dict, prompt: dict, completion_fraction: float,
                    eval_prompts: int, guard_rounds: int) -> float:
    """Both policies on the eval prompts, a look of eval_batch_prompts at a time (the baseline
    again in lockstep with the candidate, for the drift), and on the guard set's rounds."""
    look = max(1, config.eval_batch_prompts)
    seconds = sum(3 * decode_products(config, rates, prompt, min(look, eval_prompts - start),
                                      config.eval_group_size, completion_fraction)
                  for start in range(0, eval_prompts, look))
    if config.guard.enabled:
        seconds += guard_rounds * 2 * decode_products(
            config, rates, prompt, config.guard.prompts, config.guard.group_size,
            completion_fraction)
    return seconds


def workload_seconds(config: RunConfig, rates: dict, prompt: dict, weight_bytes: int,
                     checkpoint_bytes: int, upper: bool) -> dict:
    """Each stage's forecast seconds and their total, expected (`upper` False) or upper.
    `prompt`: mean prompt tokens, {"shared": the prefix every prompt starts with, "own": the
    rest}; `checkpoint_bytes`: what one step's checkpoint serialises."""
    completion = 1.0 if upper else PLANNING["completion_fraction"]
    valid = 1.0 if upper else PLANNING["valid_group_fraction"]
    eval_prompts, guard_rounds = expected_retest(config)["most" if upper else "expected"]
    slowdown = UPPER_SLOWDOWN if upper else 1.0
    share, passes = STAGE_PRODUCT_SHARE, STEP_WEIGHT_PASSES
    weight_pass = weight_bytes * rates["cast_per_byte"]
    rollout = config.steps * decode_products(config, rates, prompt, config.prompts_per_step,
                                             config.group_size, completion)
    update = config.steps * update_products(config, rates, prompt, completion, valid)
    retest = retest_products(config, rates, prompt, completion, eval_prompts, guard_rounds)
    records = config.steps * config.prompts_per_step * config.group_size + 2 * (
        eval_prompts * config.eval_group_size
        + guard_rounds * config.guard.prompts * config.guard.group_size)
    stages = {
        "load": LOAD_WEIGHT_PASSES * weight_pass,
        "rollout": rollout / share["rollout"] + config.steps * passes["rollout"] * weight_pass,
        "update": update / share["update"] + config.steps * passes["update"] * weight_pass,
        "retest": retest / share["retest"],
        "checkpoints": config.steps * CHECKPOINT_HASH_PASSES * checkpoint_bytes
                       * rates["hash_per_byte"],
        "start and finish": rates["start"] + FINISH_SECONDS + RECORD_SECONDS * records,
    }
    stages = {name: seconds * slowdown for name, seconds in stages.items()}
    stages["total"] = sum(stages.values())
    return {name: round(seconds, 1) for name, seconds in stages.items()}


def forecast_time(config: RunConfig, rates: dict, prompt: dict, weight_bytes: int,
                  checkpoint_bytes: int, engine: str, dtype: str) -> dict:
    """The dry run's time forecast: expected and upper seconds by stage, and what it assumed."""
    retest = expected_retest(config)
    return {
        "expected_seconds": workload_seconds(config, rates, prompt, weight_bytes,
                                             checkpoint_bytes, upper=False),
        "upper_seconds": workload_seconds(config, rates, prompt, weight_bytes,
                                          checkpoint_bytes, upper=True),
        "assumed": {"engine": engine, "dtype": dtype, "device": rates["device"],
                    "prompt_tokens": {k: round(v, 1) for k, v in prompt.items()},
                    "completion_fraction": PLANNING["completion_fraction"],
                    "valid_group_fraction": PLANNING["valid_group_fraction"],
                    "retest_eval_prompts": {"expected": retest["expected"][0],
                                            "most": retest["most"][0]},
                    "guard_rounds": {"expected": retest["expected"][1],
                                     "most": retest["most"][1]}},
        "measured": {k: float(f"{v:.3g}") for k, v in rates.items() if k != "device"},
    }


def process_start_seconds() -> float:
    """Seconds since this process started (its interpreter and imports: a run pays the same)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as uptime:
            now = float(uptime.read().split()[0])
        return max(0.0, now - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def hash_seconds_per_byte(size: int = 8 * 2**20) -> float:
    """Seconds per byte of sha256 here, which the checkpoints hash (and write, at a like pace)."""
    block = os.urandom(1024) * (size // 1024)
    started = time.perf_counter()
    hashlib.sha256(block).digest()
    return (time.perf_counter() - started) / size


def measure_rates(dims: dict[str, int], dtype, device, decode_rows: int, start: float,
                  token_rows: int = 512, budget_bytes: int = 256 * 2**20) -> dict:
    """This machine's seconds for the model's products, timed on weights of its shapes.

    The decoder's four products per layer (q/k/v fused, o, gate/up fused, down) and the LM head,
    at 8 rows and at `decode_rows` (a line through the two: `step_fixed`, `step_per_row`) and at
    `token_rows` (`per_token`, the teacher-forced forwards). At most `budget_bytes` of layers are
    built (more than a CPU cache holds, so the weights stream from memory as in the run) and
    their time is scaled to the model's layer count. Each timing is the best of two after a
    warm-up: other work only ever slows a pass down. `start`: the seconds this process took to
    start and import what a run imports (`process_start_seconds` when it had)."""
    import torch

    from grpogate.engines import product, product_weights

    measuring_since = time.perf_counter()
    h, hd, inter = dims["hidden"], dims["head_dim"], dims["intermediate"]
    shapes = [(h, (dims["heads"] + 2 * dims["kv_heads"]) * hd), (dims["heads"] * hd, h),
              (h, 2 * inter), (inter, h)]  # (in, out)
    element = torch.empty((), dtype=dtype).element_size()
    layer_bytes = sum(a * b for a, b in shapes) * element
    built = max(1, min(dims["layers"], budget_bytes // layer_bytes))
    started = time.perf_counter()
    layers = [(inp, torch.full((out, inp), 0.01, dtype=dtype, device=device))
              for _ in range(built) for inp, out in shapes]
    head = torch.full((dims["vocab"], h), 0.01, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    cast_per_byte = (time.perf_counter() - started) / (built * layer_bytes + head.nbytes)
    layers, head = [(inp, product_weights(w)) for inp, w in layers], product_weights(head)
    inputs = {inp: torch.full((max(decode_rows, token_rows, 8), inp), 0.01, dtype=dtype,
                              device=device) for inp in {h, inter, dims["heads"] * hd}}

    def pass_seconds(rows: int) -> float:
        best = float("inf")
        with torch.inference_mode():
            for round_index in range(3):  # round 0 warms the kernels
                begun = time.perf_counter()
                for inp, weight in layers:
                    product(inputs[inp][:rows], weight)
                sync()  # CUDA runs the products asynchronously: wait for them
                layer_part = time.perf_counter() - begun
                product(inputs[h][:rows], head)
                sync()
                total = time.perf_counter() - begun
                if round_index:
                    best = min(best, layer_part * dims["layers"] / built + total - layer_part)
        return best

    small, large = 8, max(decode_rows, 9)
    at_small, at_large = pass_seconds(small), pass_seconds(large)
    per_row = max((at_large - at_small) / (large - small), 0.0)
    return {"device": str(device), "step_fixed": max(at_small - small * per_row, 0.0),
            "step_per_row": per_row, "per_token": pass_seconds(token_rows) / token_rows,
            "cast_per_byte": cast_per_byte, "hash_per_byte": hash_seconds_per_byte(),
            "start": start, "measuring_seconds": time.perf_counter() - measuring_since}
