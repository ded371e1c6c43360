"""A full-weight candidate (a Hugging Face checkpoint) put in the place of the trained policy.

The re-test samples the candidate through `sampling_weights(policy)`, which for a full
checkpoint swaps every base tensor of the loaded baseline for the checkpoint's for the duration
of the candidate's pass and puts the originals back (inputs/policy.py). That is the
checkpoint's own function only where the architecture is the baseline's exactly, so before a
tensor loads: the checkpoint's config.json must describe the baseline's model (every field but
the ones that name, date or type the file), and its tensors must be the baseline's by name,
shape and dtype, each of the baseline's tensors present once (a tied pair, such as the input
embedding and the LM head of a model with tie_word_embeddings, may be stored once or twice, and
twice only as equal tensors). Anything else is one InputError naming the file and the field or
tensor. The tensors load from safetensors alone (files listed by inputs/candidate_dir.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from grpogate.errors import InputError
from grpogate.files.tensors import SAFETENSORS_DTYPES
from grpogate.inputs.candidate_dir import MODEL_CONFIG, Candidate
from grpogate.inputs.policy import Policy

# config.json fields that say where, when, by what or for what a file was written, or how a
# loader should place it, not what the model computes: a checkpoint may differ there.
UNCOMPUTED_FIELDS = frozenset({
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures",
    "use_cache", "_commit_hash", "_attn_implementation_autoset", "output_attentions",
    "output_hidden_states", "return_dict",
    # token ids the generation loop reads, not the forward: trainers often rewrite them
    "pad_token_id", "bos_token_id", "eos_token_id"})


def check_config(policy: Policy, candidate: Candidate) -> None:
    """The checkpoint's config.json read into the baseline's config class: every field the
    model computes with must equal the baseline's (a field the file leaves out takes the
    class's default, as a loader would give it)."""
    where = candidate.directory / MODEL_CONFIG
    baseline = policy.model.get_base_model().config
    if candidate.config.get("model_type") != baseline.model_type:
        raise InputError(f'{where}: field "model_type" is {candidate.config.get("model_type")!r}, '
                         f"the baseline's is {baseline.model_type!r}")
    try:
        theirs = type(baseline).from_dict(dict(candidate.config)).to_dict()
    except Exception as error:  # a stranger's file: whatever transformers raises is bad input
        raise InputError(f"{where}: {baseline.model_type} cannot read it "
                         f"({type(error).__name__}: {str(error)[:160]})") from None
    ours = baseline.to_dict()
    for key in sorted(set(ours) | set(theirs)):
        if key not in UNCOMPUTED_FIELDS and theirs.get(key) != ours.get(key):
            raise InputError(f'{where}: field "{key}" is {str(theirs.get(key))[:80]}, the '
                             f"baseline's is {str(ours.get(key))[:80]}; the re-test runs the "
                             "baseline's architecture, so the checkpoint must be of it")


def _baseline_tensors(policy: Policy) -> list[dict]:
    """The baseline's base tensors, one entry per tensor object: {"names": the checkpoint
    names it may be stored under (a tied tensor has several), "tensor", "slots": every
    (module, attribute) holding it}. LoRA tensors are not the base model's."""
    entries: dict[int, dict] = {}
    base = policy.model.get_base_model()
    for module_name, module in base.named_modules(remove_duplicate=False):
        if "lora_" in module_name:
            continue
        for attribute, tensor in module._parameters.items():
            if tensor is None or "lora_" in attribute:
                continue
            name = f"{module_name}.{attribute}".replace(".base_layer", "")
            entry = entries.setdefault(id(tensor), {"names": [], "tensor": tensor, "slots": []})
            entry["slots"].append((module, attribute))
            if name not in entry["names"]:
                entry["names"].append(name)
    return list(entries.values())


def _each_weight_file(candidate: Candidate, read, failure: str) -> None:
    """`read(path, handle)` for every weight file, opened by safetensors; anything safetensors
    or the read raises is InputError naming the file and `failure` (a stranger's file: any
    failure is bad input)."""
    from safetensors import safe_open

    for name in candidate.weights:
        path = candidate.directory / name
        try:
            with safe_open(str(path), framework="pt") as handle:
                read(path, handle)
        except Exception as error:  # noqa: BLE001
            raise InputError(f"{path}: {failure} ({type(error).__name__}: "
                             f"{str(error)[:160]})") from None


def _stored(candidate: Candidate) -> dict[str, tuple[Path, str, tuple]]:
    """{tensor name: (file, torch dtype name, shape)} from the weight files' headers."""
    stored = {}

    def read(path, handle):
        for tensor in handle.keys():
            view = handle.get_slice(tensor)
            stored[tensor] = (path, SAFETENSORS_DTYPES.get(view.get_dtype(), (
                view.get_dtype(),))[0], tuple(view.get_shape()))

    _each_weight_file(candidate, read, "not a safetensors file safetensors reads")
    return stored


def _matched(candidate: Candidate, entries: list[dict]) -> list[tuple[dict, list[str]]]:
    """(baseline entry, the names the checkpoint stores it under) for every baseline tensor;
    InputError for a tensor missing, extra, or of another shape or dtype."""
    stored = _stored(candidate)
    known = {name for entry in entries for name in entry["names"]}
    extra = sorted(set(stored) - known)
    if extra:
        raise InputError(f"{stored[extra[0]][0]}: tensor {extra[0]!r} is not one of the "
                         f"baseline's ({len(extra)} such); another architecture?")
    matched = []
    for entry in entries:
        present = [name for name in entry["names"] if name in stored]
        if not present:
            raise InputError(f"{candidate.directory}: no tensor {entry['names'][0]!r} (the "
                             "baseline's) in the checkpoint's weight files")
        ours = (str(entry["tensor"].dtype), tuple(entry["tensor"].shape))
        for name in present:
            path, dtype, shape = stored[name]
            if (dtype, shape) != ours:
                raise InputError(f"{path}: tensor {name!r} is {dtype.removeprefix('torch.')} "
                                 f"{list(shape)}, the baseline's is "
                                 f"{ours[0].removeprefix('torch.')} {list(ours[1])}" + (
                                     f" (load the baseline with --dtype "
                                     f"{dtype.removeprefix('torch.')})" if shape == ours[1]
                                     else ""))
        matched.append((entry, present))
    return matched


def attach_full_candidate(policy: Policy, candidate: Candidate) -> None:
    """Check the checkpoint against the baseline's architecture and hold its tensors as the
    candidate's weights (`policy.full_weights`: (module, attribute, tensor) for every slot of
    every base tensor), on the policy's device. InputError before any tensor loads when the
    config, a name, a shape or a dtype differs; after, when a tied pair differs."""
    check_config(policy, candidate)
    matched = _matched(candidate, _baseline_tensors(policy))
    wanted = {name for _, present in matched for name in present}
    loaded = {}

    def read(path, handle):
        for name in handle.keys():
            if name in wanted:
                loaded[name] = handle.get_tensor(name).to(policy.device)

    _each_weight_file(candidate, read, "its tensors do not load")
    weights = []
    for entry, present in matched:
        tensor = loaded[present[0]]
        for other in present[1:]:
            if not torch.equal(tensor, loaded[other]):
                raise InputError(f"{candidate.directory}: tensors {present[0]!r} and {other!r} "
                                 "are one tied tensor in the baseline but differ here")
        weights += [(module, attribute, tensor) for module, attribute in entry["slots"]]
    policy.full_weights = weights
