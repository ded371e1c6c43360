"""The fields of a stranger's adapter_config.json that PEFT matches as regular expressions,
held to plain module names before PEFT sees them.

PEFT (0.21) runs Python's backtracking `re` engine on several adapter_config.json fields: a
string `target_modules` or `exclude_modules` is `re.fullmatch`ed against every module name,
and each `layers_pattern`, `modules_to_save` entry and `rank_pattern` / `alpha_pattern` key is
pasted into a pattern such as `(.*\\.)?(KEY)$`. A pattern like `(.*)*y` takes time exponential
in the length of a module name: loading such an adapter never returns. So `target_modules`
and `exclude_modules` must be lists of strings (PEFT compares a listed name with `==` and
`str.endswith`, never as a pattern) or, for `target_modules`, PEFT's keyword "all-linear";
every string PEFT pastes into a pattern must be a plain module name (letters, digits, `_` and
`.`, at most MAX_NAME_CHARS). A plain name has no quantifier and no group; pasted into PEFT's
patterns, it makes a match cost at most O(key x name) steps (key: a module's dotted name,
under a few hundred characters; name: at most MAX_NAME_CHARS), so loading costs modules x
names x that: bounded by the number of entries, whatever they hold, and that number is held
to MAX_NAMES a field (a list of 400,000 names kept PEFT matching for over 300 s).
A regex `target_modules` (PEFT accepts one, few adapters use one) is refused, not matched:
list the module names instead.
"""

from __future__ import annotations

import re

from grpogate.errors import InputError

ALL_LINEAR = "all-linear"  # PEFT's keyword: every linear layer but the output head
MAX_NAME_CHARS = 256
# Entries of one list or table field. A model's distinct linear modules number a few hundred
# (an 80-layer 72B model has 560 projections), and a rank_pattern naming each by its full path
# is that long; 4096 holds a 500-layer model's. PEFT compares each module with each entry, so
# loading costs modules x entries: about 560 x 4096 = 2.3 million suffix tests at most.
MAX_NAMES = 4096
PLAIN_NAME = re.compile(r"[A-Za-z0-9_.]{1,%d}" % MAX_NAME_CHARS)
SUFFIX_LISTS = ("target_modules", "exclude_modules")  # a list: names compared, a str: a regex
PASTED_LISTS = ("modules_to_save", "layers_pattern")  # each name pasted into a pattern
PATTERN_TABLES = ("rank_pattern", "alpha_pattern")  # each key pasted into a pattern


def _refuse(where: str, field: str, value) -> None:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise InputError(f'{where}: field "{field}" is {shown}; grpogate loads an adapter whose '
                     "module patterns are plain module names (letters, digits, _ and ., at "
                     f"most {MAX_NAME_CHARS}) or target_modules \"{ALL_LINEAR}\": PEFT matches "
                     "these as regular expressions, which a pattern can make run for ever; "
                     "list the module names instead")


def _names(where: str, field: str, value) -> None:
    _count(where, field, value)
    for name in value:
        if not (isinstance(name, str) and PLAIN_NAME.fullmatch(name)):
            _refuse(where, field, name)


def _count(where: str, field: str, value) -> None:
    if len(value) > MAX_NAMES:
        raise InputError(f'{where}: field "{field}" has {len(value)} entries, over the '
                         f"{MAX_NAMES} grpogate lets PEFT match against every module (a "
                         "model's linear modules number a few hundred); list the module names "
                         "once each, or use target_modules \"all-linear\"")


def check_module_patterns(config, where: str) -> None:
    """InputError naming `where` (the adapter_config.json) and the field when PEFT would treat
    a string as a regular expression that is not a plain module name (the module's docstring).
    A config that is not a JSON object is left to the caller's own refusal."""
    if not isinstance(config, dict):
        return
    for field in SUFFIX_LISTS:
        value = config.get(field)
        if value is None or (field == "target_modules" and value == ALL_LINEAR):
            continue
        if not isinstance(value, list):
            _refuse(where, field, value)
        _count(where, field, value)
        if not all(isinstance(name, str) for name in value):
            _refuse(where, field, value)
    for field in PASTED_LISTS:
        value = config.get(field)
        if value is None:
            continue
        if isinstance(value, str) and field == "layers_pattern":
            value = [value]  # PEFT takes one layer name or a list of them
        if not isinstance(value, list):
            _refuse(where, field, value)
        _names(where, field, value)
    for field in PATTERN_TABLES:
        value = config.get(field)
        if value is None:
            continue
        if not isinstance(value, dict):
            _refuse(where, field, value)
        _names(where, field, list(value))


def lora_targets(configured: str) -> str | list[str]:
    """The config's `lora_target_modules` as PEFT takes it: "all-linear", or the list of the
    comma-separated module names (a list: PEFT compares names, never runs a pattern)."""
    if configured == ALL_LINEAR:
        return ALL_LINEAR
    return [name.strip() for name in configured.split(",") if name.strip()]


def plain_targets(configured: str) -> bool:
    """Whether `lora_target_modules` is "all-linear" or a comma list of plain module names."""
    targets = lora_targets(configured)
    return targets == ALL_LINEAR or (bool(targets) and all(PLAIN_NAME.fullmatch(name)
                                                             for name in targets))
