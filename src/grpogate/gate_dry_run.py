"""`grpogate gate --dry-run`: every check the gate makes before it samples, and the plan its
re-test follows, with nothing written.

The gate's own admission (trl_gate.admit: the door's checks of the candidate or the TRL
directory and its log, the output path, the verifier, the eval set, the training prompts and
their isolation), then what `gate` checks once the baseline loads, made from its config and
tokenizer: the baseline resolved as the gate resolves it (a hub id at its pinned commit), an
adapter's base model against it, the guard set, the eval and guard prompts' token lengths, and
the candidate's weights' values (read from the folder itself: the gate reads its copy). A full
checkpoint's tensors are checked against the baseline's architecture when the baseline loads.
Its cost figures are the run's (planning.cost_figures) for the load and the re-test alone.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from grpogate import planning
from grpogate.admission import retest_plan, runtime_plan
from grpogate.config import RunConfig
from grpogate.evidence.assemble import library_versions
from grpogate.inputs.candidate_dir import PEFT_ADAPTER, finite_weights
from grpogate.inputs.policy import default_cache_dir, resolve_base_model, weightless_model
from grpogate.sampling.rollout import encode_prompts
from grpogate.trl_gate import GateRequest, admit, baseline_identity, guard_problems

FULL_CHECKPOINT_IDENTITY = ("a full checkpoint: its config.json and every tensor's name, shape and "
                            "dtype are checked against the baseline's architecture when it loads")


def dry_run(config: RunConfig, request: GateRequest) -> dict:
    """The gate's checks before sampling; InputError where the gate would refuse. -> the plan:
    what is gated against what, on which engine, device and dtype, and what the re-test can
    resolve."""
    from transformers import AutoTokenizer

    admitted = admit(config, request)
    config, found = admitted.config, admitted.found
    base = resolve_base_model(config.model, config.model_revision, default_cache_dir(config),
                              weights=False)
    identity = (baseline_identity(found.base_model_name, base) if found.kind == PEFT_ADAPTER
                else {"baseline": base.identity(), "matches": True,
                      "how": FULL_CHECKPOINT_IDENTITY})
    guard_set, guard_identity, _ = guard_problems(admitted)
    tokenizer = AutoTokenizer.from_pretrained(base.load_dir, trust_remote_code=False)
    for problems in (admitted.eval_set, guard_set):
        encode_prompts(tokenizer, problems, config.resolved_system_prompt(),
                       config.max_prompt_tokens)
    runtime = runtime_plan(config, weightless_model(base.load_dir))
    return {"run_dir": str(admitted.run_dir), "door": "candidate" if request.candidate else
            "from-trl", "baseline": base.identity(), "adapter": config.adapter or None,
            "candidate": {"kind": found.kind, "directory": str(found.directory),
                          "files": found.files, "weights": found.weights,
                          "pickles_not_loaded": found.pickles_not_loaded},
            "baseline_identity": identity,
            "finite_weights": finite_weights(found.directory, found.weights),
            **runtime,
            "verifier": admitted.verifier.version,
            "train_prompts": len(admitted.train) if admitted.train is not None else None,
            "eval_prompts": len(admitted.eval_set), "guard_prompts": len(guard_set),
            "guard_set": guard_identity, "isolation": admitted.isolation,
            "settings": admitted.settings or None, "retest_plan": retest_plan(config),
            "gates": dataclasses.asdict(config.gates), "libraries": library_versions(),
            **planning.cost_figures(SimpleNamespace(config=config, train=[],
                                                    eval=admitted.eval_set + guard_set),
                                    base, tokenizer, runtime, train=False)}
