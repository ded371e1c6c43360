"""Pre-flight: what a run checks after loading and a dry run checks without loading.

The memory estimate and disk room (inputs/budget.py, pure arithmetic) against what this
machine has, the prompts' token lengths and the LoRA target modules. `pipeline.prepare` calls
`check_budget` once the weights are loaded and before the run directory exists; `grpogate run
--dry-run` calls `dry_run_checks` with the model's config.json and tokenizer only, so it
refuses what the run would refuse, with the same message.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from grpogate.inputs import budget
from grpogate.inputs.policy import check_target_modules, resolve_device, resolve_dtype
from grpogate.sampling.rollout import encode_prompts


def dry_run_checks(admission, source) -> int:
    """The checks `prepare` makes after loading, made from the model's config and tokenizer."""
    from transformers import AutoTokenizer

    config = admission.config
    model_config = json.loads((Path(source.load_dir) / "config.json").read_text(encoding="utf-8"))
    tokenizer = AutoTokenizer.from_pretrained(source.load_dir)
    for problems in (admission.train, admission.eval):
        encode_prompts(tokenizer, problems, config.resolved_system_prompt(),
                       config.max_prompt_tokens)
    if not admission.adapter:
        check_target_modules(source.load_dir, config)
    device = resolve_device(config.device)
    dims = budget.model_dims(model_config)
    dtype_bytes = torch.empty((), dtype=resolve_dtype(config.dtype, device)).element_size()
    estimate = budget.check_fits(config, dims, dtype_bytes, available_memory(device), str(device))
    budget.check_output_writable(admission.run_dir, budget.checkpoint_bytes(config, dims))
    return estimate["total"]


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_allocated(device)
    return budget.available_host_memory()


def check_budget(admission, policy) -> None:
    """Refuse, before anything is written, a run whose shapes cannot fit in memory or on disk."""
    base = policy.model.get_base_model()
    dims = budget.model_dims(base.config.to_dict())
    dtype_bytes = next(base.parameters()).element_size()
    budget.check_fits(admission.config, dims, dtype_bytes, available_memory(policy.device),
                      str(policy.device))
    if not admission.run_dir.exists():
        budget.check_output_writable(admission.run_dir,
                                     budget.checkpoint_bytes(admission.config, dims))
