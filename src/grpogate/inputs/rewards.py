"""Reward functions: the weighted components a training completion is scored by.

Pure Python (no torch), like the verifiers. A run's `rewards` names its components with weights,
as TRL's `reward_funcs` + `reward_weights` do; the built-in ones are

- `correctness`: the task's verifier (the only component the delivery decision ever reads: the
  re-test's mean reward and pass@group are correctness alone);
- `format`: 1.0 when the completion's last non-blank line is the answer in the expected form
  (`Answer: <number>` or `#### <number>`), else 0.0;
- `overlong`: DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), a
  penalty that grows linearly over the last `overlong_buffer_len` tokens of the budget;

and `module:function` is a user's pure-Python `(completion, reference) -> float`, run under a
time limit; an exception, a timeout, a non-finite result or one beyond +-MAX_REWARD_VALUE scores
0.0 and is counted.
A TRL reward function is taken as it is (`trl_signature`: it has a `completions` parameter):
`f(prompts, completions, **kwargs) -> list[float | None]`, called with one conversational
prompt (the user message), one completion (`[{"role": "assistant", "content": text}]`) and the
problem's `reference` column; `None` means "not applicable" and the component's value is None.
Every component has a `version`; the weighted total is `math.fsum(weight * value)` over the
components that apply — TRL's `nansum`, None counting as 0 (a completion no component applies
to totals 0.0, where TRL would mark it unscorable).

User code is imported only when the user names it: a run imports what its own config names, and
the audit of a run directory (a stranger's data) takes user components as recorded unless the
user vouches for the code with `--trust-reward-code` (`build_reward_set`'s `importable`).

>>> format_reward("so 3 + 4 = 7\\nAnswer: 7")
1.0
>>> format_reward("The answer is 7.")
0.0
>>> soft_overlong_punishment(10, max_new_tokens=48, buffer_len=16)
0.0
>>> soft_overlong_punishment(40, max_new_tokens=48, buffer_len=16)
-0.5
"""

from __future__ import annotations

import hashlib
import inspect
import json
import importlib
import linecache
import math
import re
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Mapping

from grpogate.config import BUILT_IN_REWARDS, MAX_REWARD_VALUE, USER_REWARD_PATH

CORRECTNESS, FORMAT, OVERLONG = BUILT_IN_REWARDS
FORMAT_VERSION = "format-final-answer-line-v1"
# The last non-blank line is "Answer: N" (any case) or "#### N"; N a plain or separated number.
# One fixed-width scan of a single line: linear in its length.
_FORMATTED_LINE = re.compile(r"(?:answer:|####)[ \t]*[-+]?\$?[0-9][0-9,]*(?:\.[0-9]+)?\.?[ \t]*",
                             re.ASCII | re.IGNORECASE)


def format_reward(completion: Any, reference: Any = None) -> float:
    """1.0 when the last non-blank line is `Answer: <number>` or `#### <number>`, else 0.0."""
    if not isinstance(completion, str):
        return 0.0
    lines = [line for line in completion.splitlines() if line.strip()]
    return 1.0 if lines and _FORMATTED_LINE.fullmatch(lines[-1].strip()) else 0.0


def soft_overlong_punishment(completion_tokens: int, *, max_new_tokens: int, buffer_len: int,
                             penalty_factor: float = 1.0) -> float:
    """DAPO's length penalty: 0 up to max_new_tokens - buffer_len tokens, then falling linearly
    to -penalty_factor at max_new_tokens, and -penalty_factor beyond it."""
    expected = max_new_tokens - buffer_len
    if completion_tokens <= expected:
        return 0.0
    if completion_tokens <= max_new_tokens:
        return (expected - completion_tokens) / buffer_len * penalty_factor
    return -penalty_factor


class TimeLimitExceeded(BaseException):
    """A user reward function ran past its time limit. A BaseException, so that a user
    function's own `except Exception` cannot swallow it and run on."""


def call_with_time_limit(function: Callable, args: tuple, seconds: float) -> Any:
    """`function(*args)`, stopped after `seconds`: by a timer signal on the main thread (which
    interrupts Python bytecode; a single long C call is interrupted when it returns), else by
    abandoning a daemon worker thread. Raises TimeLimitExceeded."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        def expire(signum, frame):
            raise TimeLimitExceeded(f"over {seconds} s")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return function(*args)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["value"] = function(*args)
        except BaseException as error:  # handed to the caller below
            outcome["error"] = error

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeLimitExceeded(f"over {seconds} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def user_reward_names(specs: list) -> list[str]:
    """The `module:function` components of a `rewards` list: the code a reward set would import."""
    return [spec["name"] for spec in specs or [] if isinstance(spec, dict)
            and isinstance(spec.get("name"), str) and USER_REWARD_PATH.fullmatch(spec["name"])]


def _imported_or_found(name: str, path: list[str] | None):
    """The spec of `name`: an imported module's own, else the first one the meta path finders
    return for the parent's search locations `path` (None: sys.path), as the import system
    looks it up once the parent is imported. Finding runs no module code."""
    if name in sys.modules:
        return getattr(sys.modules[name], "__spec__", None)
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        spec = find_spec(name, path) if find_spec is not None else None
        if spec is not None:
            return spec
    return None


def _within(paths: list[str], directories: list[str]) -> bool:
    """Whether every path, symlinks resolved, lies inside one of the (resolved) directories."""
    roots = [Path(directory).resolve() for directory in directories]
    return all(any(Path(path).resolve().is_relative_to(root) for root in roots)
               for path in paths)


def locate_module(module_name: str):
    """The spec the import of `module_name` loads, found without importing (running) it or any
    parent package: each dotted level is looked up in its parent's search locations (an
    imported parent's `__path__`, else the directories its spec names), which is what
    importlib.util.find_spec does after importing the parent. A level not yet imported must
    lie, file and directories with symlinks resolved, inside its parent's directories, and a
    package's `__init__.py` inside its own directory: so the module's file is inside every
    directory whose `__init__.py` the import runs (the run-directory check of
    --trust-reward-code rests on this). ValueError when a level is not found, is not a
    package, or leads out of its parent."""
    spec, locations = None, None
    parts = module_name.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        imported = name in sys.modules
        spec = _imported_or_found(name, locations)
        if spec is None:
            raise ValueError(f"cannot import module {module_name!r} ({name!r} not found); put "
                             "it on PYTHONPATH")
        origin = [spec.origin] if spec.has_location and spec.origin else []
        own = list(spec.submodule_search_locations or [])
        if not imported and ((locations is not None and not _within(origin + own, locations))
                             or (origin and own and not _within(origin, own))):
            raise ValueError(f"module {name!r} leads out of its package directory (a symlink?); "
                             "it is not imported")
        locations = list(getattr(sys.modules[name], "__path__", None) or []) if imported else own
        if depth < len(parts) and not locations:
            raise ValueError(f"cannot import module {module_name!r} ({name!r} is not a package)")
    return spec


def user_reward_source(path: str, run_dir: Path | None = None) -> tuple[str, str]:
    """(version, file) of a `module:function` path's module: `module:function@sha256:<16 hex>`
    of its source and the file that source is read from, the module located once by
    `locate_module`, without running it or its parent packages (the audit compares the version
    with the recorded one before it imports anything). ValueError when the module is not
    found, when it would be imported from inside `run_dir` (checked before its source is read:
    a run directory's code is never trusted), or when it has no source to version it by."""
    module_name = path.partition(":")[0]
    try:
        spec = locate_module(module_name)
    except ValueError:
        raise
    except Exception as error:  # a finder failing on the user's import path is their input error
        raise ValueError(f"cannot import module {module_name!r} ({type(error).__name__}: "
                         f"{error}); put it on PYTHONPATH") from None
    origin = (spec.origin or "") if spec.has_location else ""
    if run_dir is not None and origin and Path(origin).resolve().is_relative_to(
            run_dir.resolve()):
        raise ValueError("the module would be imported from inside the run directory; trusted "
                         "code must be your own")
    if not spec.has_location or not spec.origin or not spec.origin.endswith(".py"):
        raise ValueError(f"module {module_name!r} has no readable source to version it by")
    # linecache is how inspect.getsource reads a module: the same text, so the same version.
    linecache.checkcache(spec.origin)
    source = "".join(linecache.getlines(spec.origin)).encode("utf-8")
    if not source:
        raise ValueError(f"module {module_name!r} has no readable source to version it by")
    return f"{path}@sha256:{hashlib.sha256(source).hexdigest()[:16]}", spec.origin


def load_user_reward(path: str, source: tuple[str, str] | None = None) -> tuple[Callable, str]:
    """(function, version) of a `module:function` path; the version pins the module's source by
    sha256, so editing the function changes every trajectory's identity. `source`: its
    (version, file) as `user_reward_source` already found them (not located again). ValueError
    when the module or function cannot be found, or the import loads another file than the one
    versioned (a parent package that changes its `__path__`). Imports (runs) the module: call
    it only for a path the user named."""
    version, versioned = source or user_reward_source(path)
    module_name, _, function_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # any import-time failure is the user's input error
        raise ValueError(f"cannot import module {module_name!r} ({type(error).__name__}: "
                         f"{error}); put it on PYTHONPATH") from None
    loaded = getattr(getattr(module, "__spec__", None), "origin", None)
    if not loaded or Path(loaded).resolve() != Path(versioned).resolve():
        raise ValueError(f"module {module_name!r} was imported from {loaded}, not from the "
                         f"versioned {versioned}")
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"module {module_name!r} has no function {function_name!r}")
    return function, version


TRL_SIGNATURE_SUFFIX = "+trl-signature"  # on a TRL-style function's version: called another way


def trl_signature(function: Callable) -> bool:
    """Whether `function` is written for TRL's `reward_funcs` (a `completions` parameter)."""
    try:
        return "completions" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the classic form
        return False


class TrlStyleReward:
    """A TRL reward function called one completion at a time, as RewardSet scores."""

    def __init__(self, function: Callable) -> None:
        self.function = function

    def __call__(self, completion: Any, reference: Any, question: str = "",
                 columns: str = "") -> float | None:
        # A dataset row's other columns reach the function as keyword arguments, one value per
        # completion, as TRL passes them; the names grpogate passes itself keep their meaning.
        extra = {key: [value] for key, value in (json.loads(columns) if columns else {}).items()
                 if key not in ("prompts", "completions", "reference")}
        values = self.function(prompts=[[{"role": "user", "content": question}]],
                               completions=[[{"role": "assistant", "content": completion}]],
                               reference=[reference], **extra)
        if not isinstance(values, (list, tuple)) or len(values) != 1:
            raise ValueError(f"returned {values!r}, not a list of one reward per completion")
        return values[0]


@dataclass
class RewardSet:
    """The run's reward components, their weights and versions, and the errors they caused."""

    weights: dict[str, float]  # component name -> weight, in the configured order
    versions: dict[str, str]
    functions: dict[str, Callable]  # (completion, reference, completion_tokens) -> float
    user_time_limit_seconds: float = 1.0
    error_counts: dict[str, int] = field(default_factory=dict)
    # User components not imported (an audit without --trust-reward-code): their values are
    # taken from the record being checked, their versions from the recorded evidence.
    as_recorded: tuple[str, ...] = ()

    @property
    def error_count(self) -> int:
        return sum(self.error_counts.values())

    def score(self, completion: Any, reference: Any, completion_tokens: int,
              correctness: float, question: str = "", recorded: dict | None = None,
              taken: Collection[str] = (), columns: str = "") -> dict[str, float | None]:
        """Every component's value; `correctness` is the verifier's reward, scored by the caller
        (the verifier keeps its own error count); an `as_recorded` component's value, and one
        named in `taken`, is `recorded[name]` (the caller checks it is a number or None).
        `question`: the prompt a TRL-style function receives, `columns` its row's other columns
        (a dataset task's, JSON text). A TRL-style function's None
        ("not applicable") stays None."""
        values = {}
        for name in self.weights:
            if name == CORRECTNESS:
                values[name] = float(correctness)
            elif name in self.as_recorded or name in taken:
                value = (recorded or {})[name]
                values[name] = None if value is None else float(value)
            else:
                values[name] = self._guarded(name, completion, reference, completion_tokens,
                                             question, columns)
        return values

    def _guarded(self, name: str, completion: Any, reference: Any, tokens: int,
                 question: str = "", columns: str = "") -> float | None:
        function = self.functions[name]
        try:
            if isinstance(function, TrlStyleReward):
                value = call_with_time_limit(function, (completion, reference, question, columns),
                                             self.user_time_limit_seconds)
                if value is None:
                    return None
            elif USER_REWARD_PATH.fullmatch(name):
                value = call_with_time_limit(function, (completion, reference),
                                             self.user_time_limit_seconds)
            else:
                value = function(completion, reference, tokens)
            value = float(value)
            if not abs(value) <= MAX_REWARD_VALUE:  # NaN and infinities too
                raise ValueError(f"reward {value!r} outside +-{MAX_REWARD_VALUE:g}")
        except (Exception, TimeLimitExceeded):  # user code: any failure scores 0 and is counted
            self.error_counts[name] = self.error_counts.get(name, 0) + 1
            return 0.0
        return value

    def total(self, values: dict[str, float | None]) -> float:
        """The weighted sum over the components that apply (None: TRL's nansum skips it)."""
        return math.fsum(self.weights[name] * values[name] for name in self.weights
                         if values[name] is not None)

    def describe(self) -> list[dict]:
        return [{"name": name, "weight": weight, "version": self.versions[name]}
                for name, weight in self.weights.items()]


def build_reward_set(specs: list[dict], verifier_version: str, *, max_new_tokens: int,
                     overlong_buffer_len: int, overlong_penalty_factor: float,
                     user_time_limit_seconds: float, importable: Collection[str] | None = None,
                     recorded_versions: dict | None = None,
                     located: Mapping[str, tuple[str, str]] | None = None) -> RewardSet:
    """The RewardSet of validated `rewards` entries ({"name", "weight"}); no entries means
    correctness alone with weight 1. A user `module:function` is imported only when
    `importable` is None (the caller's own config) or names it, from the file `located[name]`
    names when the caller has located it (`load_user_reward`'s `source`); any other is taken
    as recorded, its version `recorded_versions[name]`. ValueError when a user function cannot
    be loaded."""
    specs = specs or [{"name": CORRECTNESS, "weight": 1.0}]
    weights, versions, functions, as_recorded = {}, {}, {}, []
    for spec in specs:
        name = spec["name"]
        weights[name] = float(spec["weight"])
        if name == CORRECTNESS:
            versions[name], functions[name] = verifier_version, None
        elif name == FORMAT:
            versions[name] = FORMAT_VERSION
            functions[name] = lambda completion, reference, tokens: format_reward(completion)
        elif name == OVERLONG:
            versions[name] = (f"dapo-soft-overlong-v1(max_new_tokens={max_new_tokens},"
                              f"buffer_len={overlong_buffer_len},"
                              f"penalty_factor={overlong_penalty_factor!r})")
            functions[name] = lambda completion, reference, tokens: soft_overlong_punishment(
                tokens, max_new_tokens=max_new_tokens, buffer_len=overlong_buffer_len,
                penalty_factor=overlong_penalty_factor)
        elif importable is None or name in importable:
            functions[name], versions[name] = load_user_reward(name, (located or {}).get(name))
            if trl_signature(functions[name]):
                functions[name] = TrlStyleReward(functions[name])
                versions[name] += TRL_SIGNATURE_SUFFIX
        else:
            functions[name], versions[name] = None, (recorded_versions or {}).get(name)
            as_recorded.append(name)
    return RewardSet(weights, versions, functions, user_time_limit_seconds,
                     as_recorded=tuple(as_recorded))


def reward_set_from_config(config: dict, verifier_version: str, *,
                           importable: Collection[str] | None,
                           recorded_versions: dict | None = None,
                           located: Mapping[str, tuple[str, str]] | None = None) -> RewardSet:
    """The run's RewardSet from its (stored) configuration dict: the run and the audit both
    build it here, so they score with the same functions. `importable`, `located`: see
    build_reward_set (`importable` None only for a config the user gave; a run directory's
    config is data)."""
    return build_reward_set(
        config.get("rewards") or [], verifier_version, max_new_tokens=config["max_new_tokens"],
        overlong_buffer_len=config.get("overlong_buffer_len", 0),
        overlong_penalty_factor=config.get("overlong_penalty_factor", 1.0),
        user_time_limit_seconds=config.get("reward_time_limit_seconds", 1.0),
        importable=importable, recorded_versions=recorded_versions, located=located)
