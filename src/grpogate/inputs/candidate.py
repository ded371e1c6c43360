"""A candidate adapter trained elsewhere, put in the place of the policy's trained adapter.

`grpogate gate` re-tests an adapter another trainer (TRL's GRPOTrainer) produced, and
`decide --replay` re-samples such a run, with the re-test the pipeline uses: that re-test
samples the baseline through `sampling_weights(policy, baseline=True)` and the candidate
through the policy's TRAINABLE adapter. The foreign adapter keeps its own LoRA shape (rank,
alpha, target modules from its adapter_config.json), so it is loaded as a whole under the
TRAINABLE name rather than copied into a LoRA of grpogate's configured shape.
"""

from __future__ import annotations

from pathlib import Path

from grpogate.errors import InputError, first_line
from grpogate.files import ADAPTER_WEIGHTS, policy_version, safetensors_names, safetensors_sha256
from grpogate.files.tensors import safetensors_size
from grpogate.inputs.policy import (TRAINABLE, Policy, adapter_state, check_adapter_dir,
                                    current_version)


# A LoRA's A and B of rank r on a layer of shape [out, in] hold r x (in + out) values, at most
# twice the layer's when r <= min(in, out); modules saved whole (modules_to_save) add at most
# one more copy. So an adapter file past 3x its base model's weights is no adapter of it.
MAX_ADAPTER_TO_MODEL = 3


def _refuse_larger_than_its_model(policy: Policy, weights) -> None:
    """InputError, from the file's header alone, before PEFT reads a tensor byte, for adapter
    weights past MAX_ADAPTER_TO_MODEL times the base model's (a 2 GiB file on a 13 MB model
    was read whole into memory)."""
    base = policy.model.get_base_model()
    model_bytes = sum(p.numel() * p.element_size() for name, p in base.named_parameters()
                      if "lora_" not in name)
    size = safetensors_size(weights)
    if size > MAX_ADAPTER_TO_MODEL * model_bytes:
        raise InputError(f"{weights}: {size} bytes, over {MAX_ADAPTER_TO_MODEL} times its base "
                         f"model's {model_bytes} bytes of weights (a LoRA of rank up to a "
                         "layer's width, with modules saved whole, holds at most that); not an "
                         "adapter of this model")


def attach_candidate(policy: Policy, adapter_dir: str | Path) -> str:
    """Replace the policy's trained adapter by the one in `adapter_dir`; return its policy
    version. InputError when it does not load onto this base model, loads only partly, or its
    tensors change on loading (the version recorded must be the file's own)."""
    adapter_dir = check_adapter_dir(str(adapter_dir))
    model = policy.model
    _refuse_larger_than_its_model(policy, adapter_dir / ADAPTER_WEIGHTS)
    try:
        model.delete_adapter(TRAINABLE)
        model.load_adapter(adapter_dir, adapter_name=TRAINABLE, is_trainable=False)
    except (RuntimeError, ValueError, KeyError, TypeError) as error:
        raise InputError(f"{adapter_dir}: does not load onto this base model "
                         f"({first_line(error)})") from None
    model.peft_config[TRAINABLE].base_model_name_or_path = policy.base.load_dir
    model.set_adapter(TRAINABLE)
    # PEFT ignores tensors its target_modules do not name: the hash would cover unused ones.
    in_file = safetensors_names(adapter_dir / ADAPTER_WEIGHTS)
    loaded = set(adapter_state(model, TRAINABLE))
    if in_file != loaded:
        missing = sorted(in_file ^ loaded)[0]
        raise InputError(f"{adapter_dir}/{ADAPTER_WEIGHTS}: {len(in_file & loaded)} of "
                         f"{len(in_file)} tensors load onto the model (e.g. not {missing})")
    version = current_version(policy)
    expected = policy_version(policy.base.sha256, safetensors_sha256(adapter_dir / ADAPTER_WEIGHTS))
    if version != expected:
        raise InputError(f"{adapter_dir}/{ADAPTER_WEIGHTS}: its tensors change when loaded "
                         "(another dtype?); the re-test would not test the file's policy")
    return version
