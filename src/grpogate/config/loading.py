"""Loading: a configuration from the defaults, a packaged profile, a TOML file, a gates file and
`--set` overrides, validated; and the stored configuration of a run being resumed."""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import fields
from importlib import resources
from pathlib import Path
from typing import Any

from grpogate.config.schema import (MAX_STEPS, RENAMED_KEYS, USER_REWARD_PATH, RunConfig,
                                    flatten)
from grpogate.config.trl_names import grpogate_key, grpogate_table, unknown_key_words
from grpogate.config.validation import type_words, validate
from grpogate.errors import InputError
from grpogate.files import read_json
from grpogate.gates import GATE_NAMES, OPTIONAL_GATE_NAMES, SWITCH_GATE_NAMES, validate_gates


def available_profiles() -> list[str]:
    packaged = resources.files("grpogate") / "profiles"
    return ["default"] + sorted(p.name[:-5] for p in packaged.iterdir() if p.name.endswith(".toml"))


def _profile_document(name: str) -> dict:
    if name == "default":
        return {}
    # A profile is a packaged name, never a path: "../../x" is looked up, not joined (a file
    # of one's own goes through --config FILE).
    if name not in available_profiles():
        raise InputError(f"unknown profile {name!r}; known: {', '.join(available_profiles())} "
                         "(a TOML file of your own: --config FILE)")
    path = resources.files("grpogate") / "profiles" / f"{name}.toml"
    return tomllib.loads(path.read_text(encoding="utf-8"))


def _profile_table(name: str) -> dict:
    """The profile's settings; its `note` is what it is for, not a setting."""
    return {k: v for k, v in _profile_document(name).items() if k != PROFILE_NOTE_KEY}


PROFILE_NOTE_KEY = "note"


def profile_note(name: str) -> str:
    """What a packaged profile is for, as its TOML's `note` says (the run's output and the
    report show it); "" for the default, a profile without one, or one no longer packaged."""
    if name not in available_profiles():
        return ""
    note = _profile_document(name).get(PROFILE_NOTE_KEY, "")
    return note if isinstance(note, str) else ""


def _read_toml(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise InputError(f"{path}: no such config file")
    try:
        return tomllib.loads(file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: not valid TOML: {error}") from None
    except RecursionError:  # tomllib recurses per nested array or table: the stack unwinds
        raise InputError(f"{path}: not valid TOML: arrays or tables nested deeper than any "
                         "config (Python's recursion limit)") from None


def _read_gates_file(path: str) -> dict:
    """A gates file: TOML (or JSON, by its .json suffix) holding a [gates] table."""
    file = Path(path)
    if not file.is_file():
        raise InputError(f"{path}: no such gates file")
    if file.suffix == ".json":
        document = read_json(file)
    else:
        document = _read_toml(path)
    table = document.get("gates") if isinstance(document, dict) else None
    if not isinstance(table, dict) or set(document) != {"gates"}:
        raise InputError(f"{path}: a gates file holds exactly one table, [gates] "
                         "(JSON: {\"gates\": {...}})")

    known = GATE_NAMES + OPTIONAL_GATE_NAMES + SWITCH_GATE_NAMES
    for name in table:
        if name not in known:
            raise InputError(f"{path}: unknown gate {name!r} in [gates]; known gates: "
                             f"{', '.join(known)}")
    return table


def _check_gates(config: RunConfig, where: str) -> None:
    """Validate the gates right after a source set them, so the error names that source."""

    try:
        validate_gates(dataclasses.asdict(config.gates))
    except InputError as error:
        raise InputError(f"{where}: {error}") from None


def _apply(target: Any, table: dict, where: str, prefix: str = "") -> None:
    """Copy a (nested) table onto a dataclass, rejecting unknown keys and wrong types. `where`
    is the source (a file, `--set KEY=VALUE`), `prefix` the dotted path of `target` in the
    configuration: an error names both, "--set learning_rate=abc: learning_rate must be a
    number (float), got 'abc'"."""
    if not isinstance(table, dict):  # task="chain_sum" where a table of task keys belongs
        raise InputError(f"{where}: expected a table of keys (got {table!r})")
    known = {f.name: f for f in fields(target)}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if key not in known and key in RENAMED_KEYS and "epsilon" in known:
            raise InputError(f"{where}: {key!r} was renamed to {RENAMED_KEYS[key]}, TRL's name")
        if key not in known:
            raise InputError(f"{where}: {unknown_key_words(name, sorted(known), prefix)}")
        current = getattr(target, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise InputError(f"{where}: {name} must be a table of keys (got {value!r})")
            _apply(current, value, where, f"{name}.")
            continue
        setattr(target, key, _coerce(current, value, where, name))


def _coerce(current: Any, value: Any, where: str, name: str) -> Any:
    """`value` as the type of `current` (a TOML value or a --set string); InputError naming
    the source `where` and the key `name` otherwise."""
    if isinstance(current, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif isinstance(current, int) and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"{where}: {name} must be a finite number, got {value!r}")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif isinstance(current, float) and not isinstance(value, bool):
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(current, str) and isinstance(value, (str, int, float)):
        return str(value)
    elif isinstance(current, dict) and isinstance(value, dict):
        return dict(value)
    elif isinstance(current, list) and isinstance(value, (str, list)):
        # report_to: "a,b" on the command line; rewards: a TOML array of tables.
        if isinstance(value, str):
            return [n.strip() for n in value.split(",") if n.strip() and n.strip() != "none"]
        return [dict(item) if isinstance(item, dict) else item for item in value]
    raise InputError(f"{where}: {name} must be {type_words(type(current).__name__)}, "
                     f"got {value!r}")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`task.params.max_digits=3` -> (["task", "params", "max_digits"], 3); values parse as TOML."""
    if "=" not in text:
        raise InputError(f"--set {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare strings need no quotes on the command line
    return key.strip().split("."), value


def load_config(profile: str = "default", config_file: str = "", overrides: list[str] = (),
                gates_file: str = "", **named: Any) -> RunConfig:
    """Build and validate a RunConfig. `named` holds CLI flags (None = not given)."""
    for name, value in (("profile", profile), ("config_file", config_file),
                        ("gates_file", gates_file)):
        if not isinstance(value, (str, os.PathLike)):
            raise InputError(f"{name}: expected a name or path (got {value!r})")
    if isinstance(overrides, (str, bytes)) or not all(isinstance(o, str) for o in overrides):
        raise InputError(f"overrides: expected a list of 'key=value' strings (got {overrides!r})")
    config_file, gates_file = os.fspath(config_file), os.fspath(gates_file)
    config = RunConfig()
    _apply(config, _profile_table(profile), f"profile {profile}")
    config.profile = profile
    _apply_sources(config, config_file, gates_file, overrides, named)
    return validate(config)


def _apply_sources(config: RunConfig, config_file: str, gates_file: str, overrides,
                   named: dict) -> None:
    """Apply, in precedence order: the config file, the gates file, the --task flag, --set
    overrides, the other flags. `steps` (from any of them, the last wins) is applied at the end:
    it sets train_prompts = steps x prompts_per_step, whatever order the two were given in."""
    named = dict(named)
    steps, task_flag = named.pop("steps", None), named.pop("task", None)
    if config_file:
        table = grpogate_table(_read_toml(config_file), config_file)
        steps = table.pop("steps", steps)
        gives_params = isinstance(table.get("task"), dict) and "params" in table["task"]
        _switching_task(config, lambda: _apply(config, table, config_file), gives_params)
        if "gates" in table:
            _check_gates(config, config_file)
    if gates_file:
        _apply(config.gates, _read_gates_file(gates_file), gates_file, "gates.")
        _check_gates(config, gates_file)
    if task_flag is not None:
        _switching_task(config, lambda: _apply(config.task, task_flag, "task (--task)", "task."),
                        False)
    for text in overrides:
        keys, value = parse_override(text)
        keys[0] = grpogate_key(keys[0], f"--set {text}") if len(keys) == 1 else keys[0]
        if keys == ["steps"]:
            steps = value
            continue
        table: dict = {}
        cursor = table
        for key in keys[:-1]:
            cursor = cursor.setdefault(key, {})
        cursor[keys[-1]] = value
        # Task params are free-form: merge a dotted override into the existing dict.
        if keys[:2] == ["task", "params"] and len(keys) == 3:
            config.task.params = {**config.task.params, keys[2]: value}
            continue
        _switching_task(config, lambda: _apply(config, table, f"--set {text}"),
                        keys[:2] == ["task", "params"])
        if keys[0] == "gates":
            _check_gates(config, f"--set {text}")
    _apply(config, {k: v for k, v in named.items() if v is not None}, "command line")
    if steps is not None:
        count = _coerce(0, steps, "config", "steps")
        if count < 1:
            raise InputError(f"steps: must be >= 1 (got {count})")
        if count > MAX_STEPS:  # named before train_prompts = steps x prompts_per_step is
            raise InputError(f"config: steps must be at most {MAX_STEPS:,} (MAX_STEPS; got "
                             f"{count:,})")
        config.train_prompts = count * config.prompts_per_step


def _switching_task(config: RunConfig, apply, gives_params: bool) -> None:
    """Run `apply`; if it switched the task (source or name) without giving params, drop the
    previous task's params: they are another generator's keyword arguments (chain_sum's
    max_digits would make leg_counting fail, or worse, silently shape it)."""
    before = (config.task.source, config.task.name)
    apply()
    if (config.task.source, config.task.name) != before and not gives_params:
        config.task.params = {}


def resume_config(stored: dict, where: str, profile: str | None = None, config_file: str = "",
                  overrides: list[str] = (), gates_file: str = "", **named: Any) -> RunConfig:
    """The stored config of a run being resumed. A resumed run must use the identical config:
    options given with --resume may repeat stored values but never change one."""
    if not isinstance(stored, dict):
        raise InputError(f"{where}: field \"config\" is not a table")
    config = RunConfig()
    _apply(config, stored, f"{where} config")
    validate(config)
    before = flatten(config.to_dict())
    if profile is not None and profile != config.profile:
        raise InputError(f"--profile {profile}: the run was started with profile "
                         f"{config.profile!r}; a resumed run uses its stored config unchanged")
    _apply_sources(config, config_file, gates_file, overrides, named)
    after = flatten(config.to_dict())
    changed = [f"{key} (stored {before[key]!r}, given {after[key]!r})"
               for key in before if before[key] != after[key]]
    if changed:
        raise InputError(f"--resume: the options change the run's stored config: "
                         f"{'; '.join(changed)}. A resumed run uses its stored config unchanged; "
                         "start a new run (new --label) to change it")
    return validate(config)


def rewards_named_by(config_file: str = "", overrides: list[str] = ()) -> list[str]:
    """The `module:function` rewards the user's own --config FILE and --set options name: the
    only reward code `run --resume` may import (the run directory's stored config is data)."""
    config = RunConfig()
    _apply_sources(config, config_file, "", overrides, {})
    return [entry["name"] for entry in config.rewards if isinstance(entry, dict)
            and isinstance(entry.get("name"), str) and USER_REWARD_PATH.fullmatch(entry["name"])]
