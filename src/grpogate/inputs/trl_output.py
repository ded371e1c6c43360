"""A TRL output directory, read as untrusted data: the PEFT adapter and the trainer's log.

`GRPOTrainer` writes into `output_dir` (after `trainer.save_model()` / `trainer.save_state()`)
and into every `checkpoint-N/`: `adapter_config.json` + `adapter_model.safetensors` (with a
`peft_config`), `trainer_state.json` (the per-step `log_history`), the tokenizer, and pickles:
`training_args.bin`, `optimizer.pt`, `scheduler.pt`, `rng_state.pth`. A pickle can run code
when it is loaded, so none is ever opened here; the GRPO settings the log's arithmetic needs
come from `trainer_state.json` and from the user (a JSON/TOML file of GRPOConfig fields, or
flags). Full model weights without an adapter are refused: the re-test compares a baseline and
a candidate that share one loaded base model, and a policy's version is its base identity plus
its adapter's tensors.

Pure Python (no torch): every file is parsed as data with a size bound before anything loads.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from grpogate.errors import InputError
from grpogate.config.adapter_patterns import check_module_patterns
from grpogate.files import (ADAPTER_WEIGHTS, confined_path, descriptor_size,
                            parse_json, read_confined, safetensors_names)

TRAINER_STATE = "trainer_state.json"
ADAPTER_CONFIG = "adapter_config.json"
PICKLES = ("training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth",
           "pytorch_model.bin", "adapter_model.bin")
FULL_WEIGHTS = re.compile(r"model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json")
CHECKPOINT = re.compile(r"checkpoint-(\d+)")
MAX_JSON_BYTES = 64 * 1024 * 1024  # a log of 100,000 steps is about 100 MB less than this
WITHIN = "the TRL output directory"


@dataclass
class TrlOutput:
    """What `read_trl_output` found; paths are absolute."""

    directory: Path
    adapter_dir: Path
    adapter_config: dict
    trainer_state_file: Path
    trainer_state: dict
    pickles_not_loaded: list[str] = field(default_factory=list)

    @property
    def base_model_name(self) -> str:
        return str(self.adapter_config.get("base_model_name_or_path") or "")


def read_json_file(path: Path, root: Path | None = None, within: str = WITHIN) -> object:
    """A JSON document read through the confinement rule (files/confine.py) of `root` (the TRL
    output directory, named `within`; default the file's own folder): inside it once resolved,
    a regular file, at most MAX_JSON_BYTES, checked before a byte is read. InputError naming
    the file, line and column; a link out of `root` is named a link."""
    root = root or path.parent
    if path.is_symlink() and not path.resolve().is_relative_to(Path(root).resolve()):
        raise InputError(f"{path}: a symbolic link to a file outside {within}; grpogate reads "
                         "no file outside it (copy the file in its place)")
    try:  # parse_json: depth bound, duplicate keys and lone surrogates refused, as for a run
        data = read_confined(root, str(path.relative_to(root)), MAX_JSON_BYTES,
                             "a trainer's JSON file", within)
        return parse_json(data, str(path))
    except UnicodeDecodeError as error:
        raise InputError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise InputError(f"{path}:{error.lineno}: not valid JSON ({error.msg}, column "
                         f"{error.colno})") from None


def _newest_checkpoint(directory: Path) -> Path | None:
    """The highest checkpoint-N/ folder, held to the confinement rule: one that leads out of
    the TRL directory (a symlink to another folder) is refused, not followed."""
    numbered = [(int(m.group(1)), p) for p in directory.iterdir()
                if p.is_dir() and (m := CHECKPOINT.fullmatch(p.name))]
    if not numbered:
        return None
    newest = max(numbered)[1]
    confined_path(directory, newest.name, directory=True, within=WITHIN)
    return newest


def _refuse_without_adapter(directory: Path, looked_in: list[Path]) -> None:
    names = {p.name for place in looked_in for p in place.iterdir() if p.is_file()}
    if any(FULL_WEIGHTS.fullmatch(name) for name in names):
        raise InputError(f"{directory}: full model weights, no PEFT adapter; grpogate gates LoRA "
                         "adapters (train with peft_config=LoraConfig(...)), whose re-test shares "
                         "one loaded base model with the baseline")
    pickles = sorted(names & set(PICKLES))
    if pickles and not names & {ADAPTER_CONFIG, TRAINER_STATE}:
        raise InputError(f"{directory}: only pickles ({', '.join(pickles)}), which are never "
                         f"loaded; save the adapter (trainer.save_model()) and the log "
                         f"(trainer.save_state()) into the output directory")
    raise InputError(f"{directory}: no {ADAPTER_CONFIG} here or in its newest checkpoint-N/; "
                     "not a TRL output directory with a PEFT adapter")


def _adapter_dir(directory: Path) -> Path:
    """The directory's own adapter (trainer.save_model), else its newest checkpoint's."""
    checkpoint = _newest_checkpoint(directory)
    for place in (directory, checkpoint):
        if place is not None and (place / ADAPTER_CONFIG).is_file():
            return place
    _refuse_without_adapter(directory, [p for p in (directory, checkpoint) if p is not None])
    raise AssertionError("unreachable")


def read_adapter(directory: Path, adapter_dir: Path, within: str = WITHIN) -> dict:
    weights = adapter_dir / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise InputError(f"{adapter_dir}: no {ADAPTER_WEIGHTS} (adapters load only from "
                         "safetensors; adapter_model.bin is a pickle and is never loaded)")
    # The weights as the confinement rule admits them (a link out of the directory refused);
    # an empty or truncated file is bad input, here.
    # Its header alone: the tensors (up to tensors.MAX_SAFETENSORS_DATA) are read by PEFT.
    safetensors_names(confined_path(directory, str(weights.relative_to(directory)), within=within))
    config = read_json_file(adapter_dir / ADAPTER_CONFIG, directory, within)
    if not isinstance(config, dict):
        raise InputError(f"{adapter_dir / ADAPTER_CONFIG}: not a JSON object")
    if config.get("peft_type") not in (None, "LORA"):
        raise InputError(f"{adapter_dir / ADAPTER_CONFIG}: field \"peft_type\" is "
                         f"{config.get('peft_type')!r}; only LoRA adapters are gated")
    if not isinstance(config.get("base_model_name_or_path"), str) or not config["base_model_name_or_path"]:
        raise InputError(f"{adapter_dir / ADAPTER_CONFIG}: field \"base_model_name_or_path\" "
                         "missing; the adapter does not name its base model")
    check_module_patterns(config, str(adapter_dir / ADAPTER_CONFIG))  # no regex reaches PEFT
    return config


def _trainer_state_file(directory: Path, adapter_dir: Path) -> Path:
    """`trainer.save_state()`'s file (it holds train_runtime), else the adapter's checkpoint's,
    else the newest checkpoint's."""
    for place in (directory, adapter_dir, _newest_checkpoint(directory)):
        if place is not None and (place / TRAINER_STATE).is_file():
            return place / TRAINER_STATE
    raise InputError(f"{directory}: no {TRAINER_STATE} (call trainer.save_state() after "
                     "trainer.train(), or keep a checkpoint-N/)")


def _check_trainer_state(path: Path, state: object) -> dict:
    if not isinstance(state, dict):
        raise InputError(f"{path}: not a JSON object")
    history = state.get("log_history")
    if not isinstance(history, list) or not all(isinstance(e, dict) for e in history):
        raise InputError(f"{path}: field \"log_history\" must be a list of objects")
    step = state.get("global_step")
    if type(step) is not int or step < 0:
        raise InputError(f"{path}: field \"global_step\" must be a whole number >= 0")
    return state


def read_trl_output(path: str | Path) -> TrlOutput:
    """Locate and check the adapter and the log of a TRL output directory; InputError (one
    line naming the file and field) for anything missing or malformed. Opens no pickle."""
    directory = Path(path).resolve()
    if not directory.is_dir():
        raise InputError(f"{path}: no such directory (a TRL output_dir)")
    adapter_dir = _adapter_dir(directory)
    adapter_config = read_adapter(directory, adapter_dir)
    state_file = _trainer_state_file(directory, adapter_dir)
    state = _check_trainer_state(state_file, read_json_file(state_file, directory))
    pickles = sorted({str(p.relative_to(directory)) for place in (directory, adapter_dir)
                      for p in place.iterdir() if p.name in PICKLES})
    return TrlOutput(directory, adapter_dir, adapter_config, state_file, state, pickles)


# --- the GRPO settings the log's arithmetic needs -------------------------------------------

# GRPOConfig's defaults for the settings read here (TRL 1.x); num_generations and the batch
# size are never assumed: the batch size is in trainer_state.json, G is the user's to give.
TRL_DEFAULTS = {"gradient_accumulation_steps": 1, "num_iterations": 1, "num_processes": 1,
                "scale_rewards": "group", "multi_objective_aggregation": "sum_then_normalize"}
WHOLE_NUMBER_SETTINGS = ("num_generations", "per_device_train_batch_size",
                         "gradient_accumulation_steps", "num_iterations", "num_processes")
# What the evidence records of a declared GRPOConfig (a settings file holds every field).
RECORDED_SETTINGS = WHOLE_NUMBER_SETTINGS + (
    "steps_per_generation", "scale_rewards", "multi_objective_aggregation", "loss_type", "beta",
    "epsilon", "epsilon_high", "importance_sampling_level", "learning_rate", "lr_scheduler_type",
    "warmup_ratio", "max_completion_length", "temperature", "top_p", "top_k", "max_steps", "seed",
    "reward_weights", "mask_truncated_completions")


def read_settings_file(path: str) -> dict:
    """GRPOConfig fields from a JSON file (`trainer.args.to_json_string()` writes one) or a
    TOML file; unknown keys are kept as recorded settings, never executed."""
    file = Path(path)
    if not file.is_file():
        raise InputError(f"{path}: no such settings file")
    if file.suffix == ".toml":
        try:
            with open(file, "rb") as stream:  # is_file above: a regular file, never a FIFO
                size = descriptor_size(stream.fileno(), path, MAX_JSON_BYTES, "a settings file")
                document = tomllib.loads(stream.read(size).decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise InputError(f"{path}: not valid TOML ({error})") from None
        except RecursionError:  # tomllib recurses per nested array or table: the stack unwinds
            raise InputError(f"{path}: not valid TOML: arrays or tables nested deeper than any "
                             "settings file (Python's recursion limit)") from None
    else:
        document = read_json_file(file)
    if not isinstance(document, dict):
        raise InputError(f"{path}: a settings file is one object of GRPOConfig fields")
    return document


def trl_settings(output: TrlOutput, declared: dict, where: str) -> dict:
    """The settings the log is read with: TRL's defaults, then trainer_state.json's batch size,
    then what the user declared (`where` names it). Whole numbers are checked here."""
    settings = dict(TRL_DEFAULTS)
    batch = output.trainer_state.get("train_batch_size")
    if type(batch) is int:
        settings["per_device_train_batch_size"] = batch
    settings.update({k: v for k, v in declared.items() if v is not None and k in RECORDED_SETTINGS})
    steps_per_generation = settings.get("steps_per_generation")
    if steps_per_generation not in (None, settings.get("gradient_accumulation_steps")):
        raise InputError(f"{where}: steps_per_generation={steps_per_generation!r} differs from "
                         "gradient_accumulation_steps; reading such a log is not supported "
                         "(its entries do not each follow one generation)")
    for key in WHOLE_NUMBER_SETTINGS:
        value = settings.get(key)
        if type(value) is not int or value < 1:
            raise InputError(f"{where}: GRPO setting {key} must be a whole number >= 1 (got "
                             f"{value!r}); give it (e.g. --num-generations 8 or a --trl-args "
                             "file with the run's GRPOConfig fields)")
    return settings
