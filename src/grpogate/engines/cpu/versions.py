"""The library versions the accelerator's private uses were tested on.

The accelerator relies on undocumented parts of torch, transformers and PEFT: oneDNN's
weight-reorder and prepacked-linear ops (`torch.ops.mkldnn`), transformers' attention registry
and `config._attn_implementation`, the cache argument's name, modules' forward-hook tables, and
PEFT's `lora.Linear` attributes (`lora_A`, `lora_B`, `scaling`, `merged`, `use_dora`,
`lora_variant`). Any of them can change in a minor release without notice. The accelerator
therefore runs only on the minor versions its contract suite passed on (`TESTED`); on any other
the capability check declines with the version named, and the reference engine runs, which
calls transformers' and PEFT's model interfaces only. Adding a version means running
tests/test_engine_contract.py (and the accelerator's own tests) on it, then listing it here
and in pyproject.toml's comment.
"""

from __future__ import annotations

import importlib
from functools import lru_cache

TESTED = {"torch": {(2, 13)}, "transformers": {(5, 25)}, "peft": {(0, 21)}}


def _minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def installed_version(library: str) -> str | None:
    """The version of the module this process imports (not the installed metadata, which a
    path entry can shadow); None for an absent PEFT."""
    try:
        return str(importlib.import_module(library).__version__)
    except ImportError:
        if library != "peft":
            raise
        return None


@lru_cache(maxsize=1)
def untested_versions() -> str:
    """"" where every library is a tested version, else the first that is not, as a reason."""
    for library, minors in TESTED.items():
        installed = installed_version(library)
        if installed is None:
            continue  # PEFT absent: no LoRA layers to patch
        if _minor(installed) not in minors:
            tested = ", ".join(f"{a}.{b}" for a, b in sorted(minors))
            return f"{library} {installed} untested (tested: {tested})"
    return ""
