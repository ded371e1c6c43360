"""grpogate: one auditable GRPO run that ends in an accept / tune / reject decision.

The Python API (api.py): `load_config` builds a validated `RunConfig` from a profile and keys,
`run` runs it and returns a `RunResult`; every input error is an `InputError`.
"""

__version__ = "0.1.0"

from grpogate.api import RunResult, run  # noqa: E402 (the public API, after the version)
from grpogate.config import RunConfig, load_config  # noqa: E402
from grpogate.errors import InputError  # noqa: E402

__all__ = ["InputError", "RunConfig", "RunResult", "load_config", "run"]
