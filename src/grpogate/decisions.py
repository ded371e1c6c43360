"""The stable public name of the three decision functions (docs/design.md §5): pure Python,
no torch.

They live in `grpogate.evidence.decisions`; this module only re-exports them.
"""

from grpogate.evidence.decisions import (check_rollout_contract, decide_grpo_delivery,
                                         decide_run, evaluate_grpo_candidate)

__all__ = ["check_rollout_contract", "decide_grpo_delivery", "decide_run",
           "evaluate_grpo_candidate"]
