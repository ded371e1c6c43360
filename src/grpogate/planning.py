"""The dry run's cost figures: the run's expected peak memory and wall time on this machine.

`cost_figures` reads what the dry run has already resolved (the model's config.json and
tokenizer, the admitted prompts), measures this machine (forecast.measure_rates, about
a second) and states, beside the refusal bound `check_fits` applies, the memory the run is
expected to peak at (inputs/budget.expected_peak) and the seconds it is expected to take, with
an upper figure (forecast.forecast_time). docs/design.md ("The dry run's figures") says
what each figure is.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from grpogate.engines.rows import shared_prefix_length
from grpogate import forecast
from grpogate.inputs import budget
from grpogate.sampling.rollout import encode_prompts

GIB = budget.GIB
# The interpreter's start and the imports up to here (torch, transformers, grpogate's stages):
# a run pays the same before its own clock starts.
IMPORTED_AFTER_SECONDS = forecast.process_start_seconds()


def prompt_tokens(admission, tokenizer, sample: int = 1024) -> dict:
    """Mean prompt tokens of the train and eval sets (their first `sample` prompts each: the
    dry run has checked every prompt's length already): the prefix every prompt starts with
    (the system prompt and chat template, computed once per batch) and the rest."""
    config = admission.config
    encoded = [ids for problems in (admission.train, admission.eval) for ids in encode_prompts(
        tokenizer, problems[:sample], config.resolved_system_prompt(), config.max_prompt_tokens)]
    if not encoded:
        return {"shared": 0.0, "own": 0.0}
    shared = shared_prefix_length(encoded)
    return {"shared": float(shared), "own": sum(len(p) for p in encoded) / len(encoded) - shared}


def resident_bytes() -> int:
    """This process's resident memory now (what the run holds too before it loads a model)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def engine_label(runtime: dict) -> str:
    """The engine the forecast assumes, from the dry run's runtime plan
    (admission.runtime_plan): its figures were fitted on the CPU accelerator and take the
    reference engine's single weight copy on any other device."""
    engine = runtime["engine"]
    if torch.device(runtime["device"]).type != "cpu":
        return "reference"
    return f"reference ({engine['declined']})" if engine["declined"] else engine["name"]


def cost_figures(admission, source, tokenizer, runtime: dict, train: bool = True) -> dict:
    """{"memory_estimate_gib": ..., "time_estimate": ...} for the dry run's report, from the
    model's config, its `tokenizer` and the `runtime` plan the dry run has resolved. `train`
    False: a gate's (load, the re-test, the records; no steps, no optimizer)."""
    config = admission.config if train else dataclasses.replace(admission.config, train_prompts=0)
    model_config = json.loads((Path(source.load_dir) / "config.json").read_text(encoding="utf-8"))
    dims = budget.model_dims(model_config)
    prompt = prompt_tokens(admission, tokenizer)
    device, dtype = torch.device(runtime["device"]), getattr(torch, runtime["dtype"])
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    engine = engine_label(runtime)
    # On CUDA the figure is the allocator's peak (what the memory gate reads there); the
    # reference engine holds the weights once, the accelerator four times (budget).
    runtime = resident_bytes() if device.type == "cpu" else torch.cuda.memory_allocated(device)
    peak = budget.expected_peak(config, dims, dtype_bytes, prompt, runtime,
                                forecast.PLANNING["completion_fraction"],
                                forecast.PLANNING["valid_group_fraction"],
                                weight_copies=4 if engine == "cpu" else 1, train=train)
    bound = budget.memory_estimate(config, dims, dtype_bytes)["total"]
    decode_rows = min(256, max(config.prompts_per_step * config.group_size,
                               config.eval_batch_prompts * config.eval_group_size))
    rates = forecast.measure_rates(dims, dtype, device, decode_rows, IMPORTED_AFTER_SECONDS)
    time_estimate = forecast.forecast_time(
        config, rates, prompt, weight_bytes=budget.parameter_count(dims) * dtype_bytes,
        checkpoint_bytes=3 * 4 * budget.lora_parameter_count(config, dims),
        engine=engine, dtype=str(dtype).removeprefix("torch."))
    return {"memory_estimate_gib": {
                "expected_peak": round(peak["total"] / GIB, 2),
                "parts": {k: round(v / GIB, 2) for k, v in peak.items() if k != "total"},
                "refusal_bound": round(bound / GIB, 2)},
            "time_estimate": time_estimate}
