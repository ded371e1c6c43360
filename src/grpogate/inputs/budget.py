"""What a run will need, estimated at admission: memory, context length and disk.

Pure arithmetic over the configuration and the model's own config.json (no torch), so that
`grpogate run --dry-run` and the run itself refuse, before anything is written, a setting that
cannot fit (group_size=100000 asks one decode batch of 100,000 rows, whose float32 logits alone
are 100,000 x 49,152 x 4 bytes = 19.7 GB) with the estimate in the message, instead of being
killed by the kernel an hour later.

Two figures of memory. `memory_estimate` is the refusal bound: it counts the tensors whose size
the shapes fix, each at its largest (the KV cache of the largest decode batch at
max_prompt_tokens + max_new_tokens, float32 logits over the vocabulary for a whole micro-batch
at full length, its activations), so it sits well above what a run holds (the default's 5.5
GiB in bfloat16 against a measured peak of 2.9-3.1 GiB): it guards the machine against a
setting that cannot fit, and is no forecast. `expected_peak` is the forecast the dry run
states: what the run is expected to hold at its peak, at the prompts' measured lengths and the
planning figures of completion length and valid groups (docs/design.md, "The dry run's
figures").
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from grpogate.config import RunConfig
from grpogate.errors import InputError

GIB = 1024**3
ROW_BOOKKEEPING_BYTES_PER_TOKEN = 64  # token id lists, padded id / mask / log-prob copies
# What the allocator keeps of the update's freed blocks as steps of other packed lengths come:
# per step, this share of one update's activations, for the first CREEP_STEPS steps (the
# default's resident memory creeps so until about step 40, then stays flat; fitted to the
# default's, the smoke profile's and a held-out config's peaks: docs/measurements.md, "The dry
# run's forecast").
CREEP_PER_STEP = 0.076
CREEP_STEPS = 40


def model_dims(model_config: dict) -> dict[str, int]:
    """The shapes the estimate needs, from a Hugging Face config.json (Llama / Qwen2 names)."""
    hidden = int(model_config["hidden_size"])
    heads = int(model_config["num_attention_heads"])
    return {"hidden": hidden, "layers": int(model_config["num_hidden_layers"]),
            "heads": heads, "kv_heads": int(model_config.get("num_key_value_heads") or heads),
            "head_dim": int(model_config.get("head_dim") or hidden // heads),
            "intermediate": int(model_config.get("intermediate_size") or 4 * hidden),
            "vocab": int(model_config["vocab_size"]),
            "context": int(model_config.get("max_position_embeddings") or 0),
            "tied": bool(model_config.get("tie_word_embeddings", False))}


def parameter_count(dims: dict[str, int]) -> int:
    h, hd, i = dims["hidden"], dims["head_dim"], dims["intermediate"]
    attention = h * hd * (dims["heads"] + 2 * dims["kv_heads"]) + dims["heads"] * hd * h
    embeddings = dims["vocab"] * h * (1 if dims["tied"] else 2)
    return embeddings + dims["layers"] * (attention + 3 * h * i)


def lora_parameter_count(config: RunConfig, dims: dict[str, int]) -> int:
    """LoRA A and B of every linear layer of a block (the all-linear target set): r x (in + out)."""
    h, hd, i = dims["hidden"], dims["head_dim"], dims["intermediate"]
    shapes = [(h, dims["heads"] * hd), (h, dims["kv_heads"] * hd), (h, dims["kv_heads"] * hd),
              (dims["heads"] * hd, h), (h, i), (h, i), (i, h)]
    return dims["layers"] * config.lora_r * sum(a + b for a, b in shapes)


def decode_rows(config: RunConfig, prompts: int, group_size: int) -> int:
    """Rows of one decode batch: whole groups, as sampling/rollout.generate_completions packs them."""
    prompts_per_batch = max(1, config.generation_batch_size // group_size)
    return min(prompts_per_batch, prompts) * group_size


def memory_estimate(config: RunConfig, dims: dict[str, int], dtype_bytes: int) -> dict[str, int]:
    """Bytes by part (the refusal bound, see the module docstring) and their total."""
    tokens = config.max_prompt_tokens + config.max_new_tokens
    rows = max(decode_rows(config, config.prompts_per_step, config.group_size),
               decode_rows(config, config.eval_prompts, config.eval_group_size))
    kv_per_token = dims["layers"] * 2 * dims["kv_heads"] * dims["head_dim"] * dtype_bytes
    micro_tokens = config.micro_batch_size * tokens
    parts = {
        "weights": parameter_count(dims) * dtype_bytes,
        # LoRA weights, their gradients and AdamW's two moments, float32.
        "adapter and optimizer": lora_parameter_count(config, dims) * 4 * 4,
        "KV cache": rows * tokens * kv_per_token,
        "sampling logits": rows * dims["vocab"] * 4,
        "update logits": micro_tokens * dims["vocab"] * 4,
        "update activations": micro_tokens * dims["layers"] * dims["hidden"] * 2 * dtype_bytes,
        "rollout records": config.prompts_per_step * config.group_size * tokens
                           * ROW_BOOKKEEPING_BYTES_PER_TOKEN,
    }
    parts["total"] = sum(parts.values())
    return parts


def kv_cache_bytes(config: RunConfig, dims: dict[str, int], dtype_bytes: int, prompt: dict,
                   prompts: int, group_size: int) -> float:
    """A decode batch's keys and values: the shared prefix once, each prompt's own tokens once
    (its group's rows read them, sampling/rollout), every row's completion to max_new_tokens."""
    kv_per_token = dims["layers"] * 2 * dims["kv_heads"] * dims["head_dim"] * dtype_bytes
    tokens = prompt["shared"] + prompts * (prompt["own"] + group_size * config.max_new_tokens)
    return tokens * kv_per_token


def expected_peak(config: RunConfig, dims: dict[str, int], dtype_bytes: int, prompt: dict,
                  runtime_bytes: int, completion_fraction: float, valid_fraction: float,
                  weight_copies: int = 4, train: bool = True) -> dict[str, int]:
    """The run's expected peak resident memory, by part: what this process already holds
    (`runtime_bytes`: the interpreter, torch, transformers), the weights as the run holds them
    (`weight_copies`: on the CPU accelerator three from loading on, as the default's resident
    memory shows, and the baseline's copy that decodes in lockstep with the candidate in the
    re-test), the adapter and its optimizer, the training stages' larger working set (the
    rollout's, or the update's activations and what the allocator keeps of them over the
    steps; it keeps it through the re-test) and the re-test's tensors on top.
    `prompt`: mean prompt tokens {"shared", "own"}; the fractions are the planning figures of
    completion length and valid groups (forecast.PLANNING). `train` False: a gate's re-test
    alone (no rollout, update or optimizer; the adapter's weights only)."""
    weights = parameter_count(dims) * dtype_bytes
    logits_row = dims["vocab"] * 4 * 2  # float32 logits and the sampler's probabilities

    def decode(prompts: int, group_size: int, copies: int) -> float:
        prompts = min(prompts, max(1, config.generation_batch_size // group_size))
        return copies * (kv_cache_bytes(config, dims, dtype_bytes, prompt, prompts, group_size)
                         + prompts * group_size * logits_row)

    groups = min(config.prompts_per_step * valid_fraction,
                 max(1, config.micro_batch_size // config.group_size))
    update_tokens = (prompt["shared"] + groups * prompt["own"]
                     + groups * config.group_size * config.max_new_tokens * completion_fraction)
    # saved for the backward, per token and layer: the block's inputs, q/k/v, attention output,
    # the MLP's gate, up and their product
    activations = update_tokens * dims["layers"] * dtype_bytes * (
        6 * dims["hidden"] + 4 * dims["intermediate"])
    creep = CREEP_PER_STEP * min(config.steps, CREEP_STEPS)
    training = {"rollout": decode(config.prompts_per_step, config.group_size, 1),
                "update": activations * (1 + creep)}
    largest = max(training, key=training.get)
    retest = max(decode(config.eval_batch_prompts, config.eval_group_size, 2),
                 decode(config.guard.prompts, config.guard.group_size, 1)
                 if config.guard.enabled else 0)
    adapter = lora_parameter_count(config, dims) * 4
    parts = {"runtime": runtime_bytes, "weights": weight_copies * weights}
    if train:  # each adapter weight, its gradient and AdamW's two moments
        parts["adapter and optimizer"] = 4 * adapter
        parts[f"{largest} tensors"] = int(training[largest])
    else:
        parts["adapter"] = adapter
    parts["re-test tensors"] = int(retest)
    parts["total"] = sum(parts.values())
    return parts


def check_fits(config: RunConfig, dims: dict[str, int], dtype_bytes: int, available: int,
               where: str) -> dict[str, int]:
    """InputError when the context is too short or the estimate exceeds `available` bytes."""
    tokens = config.max_prompt_tokens + config.max_new_tokens
    if dims["context"] and tokens > dims["context"]:
        raise InputError(f"config: max_prompt_tokens + max_new_tokens = {tokens} exceeds the "
                         f"model's context of {dims['context']} tokens; lower max_new_tokens")
    estimate = memory_estimate(config, dims, dtype_bytes)
    if estimate["total"] > available:
        largest = sorted((k for k in estimate if k != "total"), key=estimate.get, reverse=True)[:3]
        shown = ", ".join(f"{k} {estimate[k] / GIB:.1f}" for k in largest)
        raise InputError(f"config: estimated peak memory {estimate['total'] / GIB:.1f} GiB "
                         f"({shown} GiB) exceeds the {available / GIB:.1f} GiB available on "
                         f"{where}; lower group_size, generation_batch_size, max_new_tokens or "
                         "micro_batch_size")
    return estimate


def available_host_memory() -> int:
    """MemAvailable plus what this process already holds (its weights count in the estimate)."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
        with open("/proc/self/statm", encoding="ascii") as statm:
            available += int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    return available


def checkpoint_bytes(config: RunConfig, dims: dict[str, int]) -> int:
    """Disk a run needs at its peak: two checkpoints (adapter + AdamW moments, float32) while
    the newer replaces the older, the delivered adapter, and the trajectories file."""
    adapter = lora_parameter_count(config, dims) * 4
    trajectories = config.train_prompts * config.group_size * (config.max_new_tokens * 8 + 400)
    return 2 * 3 * adapter + adapter + trajectories


def check_output_writable(run_dir: Path, needed_bytes: int) -> None:
    """The nearest existing ancestor of the run directory accepts a file and has the room;
    the OS's own reason is kept in the message (EACCES, EROFS, ENOSPC)."""
    ancestor = Path(os.path.abspath(run_dir))
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InputError(f"{run_dir}: {ancestor} is a file, not a directory")
    try:
        handle, probe = tempfile.mkstemp(prefix=".grpogate-probe-", dir=ancestor)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise InputError(f"{run_dir}: cannot write in {ancestor} ({error.strerror})") from None
    free = shutil.disk_usage(ancestor).free
    if free < needed_bytes:
        raise InputError(f"{run_dir}: {os.strerror(errno.ENOSPC)} in {ancestor}: "
                         f"{free / 2**20:.1f} MiB free, the run needs about "
                         f"{needed_bytes / 2**20:.1f} MiB for its checkpoints and records")
