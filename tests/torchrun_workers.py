"""Programs that tests/test_distributed.py launches under torchrun (never collected by pytest).

`run ARGS...`: the `grpogate` CLI with the fixed training reward of test_resume (position 0 of
every round a valid group, position 1 on about half the prompts), so steps have one or two
valid groups; writes its pid to $PID_DIR/rank<R>-attempt<A> for the kill test.
`update MODEL_DIR OUT.json`: one update per objective with the micro-batches dealt over the
ranks, against the same update in one process (world SINGLE, on rank 0).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

torch.set_num_threads(1)  # a shared 2-core machine: two ranks, one thread each

EOS = 2
# (name, UpdateSettings overrides): every loss type's normalization, GSPO's sequence ratio,
# and mu = 2 with a KL term (pi_old precomputed by the ranks and gathered).
VARIANTS = [("grpo", {}), ("bnpo", {"loss_type": "bnpo"}), ("dapo", {"loss_type": "dapo"}),
            ("dr_grpo", {"loss_type": "dr_grpo"}), ("cispo", {"loss_type": "cispo"}),
            ("gspo", {"importance_sampling_level": "sequence"}),
            ("dapo_mu2_kl_entropy", {"loss_type": "dapo", "num_iterations": 2, "beta": 0.05,
                                     "top_entropy_quantile": 0.5})]


def run_cli(argv: list[str]) -> None:
    from grpogate.training import loop as training

    training.score_completions = lambda completions, problems, verifier: [
        1.0 if c.sample_index % 2 == 0 and (
            c.prompt_index == 0 or problems[c.prompt_index].prompt_id[0] in "01234567")
        else 0.0 for c in completions]
    if os.environ.get("PID_DIR"):
        name = f"rank{os.environ['RANK']}-attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}"
        with open(os.path.join(os.environ["PID_DIR"], name), "w") as stream:
            stream.write(str(os.getpid()))
    from grpogate.cli import app

    app(argv, prog_name="grpogate")


def fixed_batch(prompts):
    """4 groups of G = 2, ragged completions: micro_batch_size 2 makes 4 micro-batches, dealt
    0, 2 to rank 0 and 1, 3 to rank 1, so the ranks' sums meet in another order than one
    process's."""
    from grpogate.training.advantages import UpdateBatch

    completions = [[504, 3077, 314, EOS], [905, 28, 17, 1120, 44, 7], [1011, 29], [9063, 17, 9, 4],
                   [77, 78, 79], [600, 601, 602, 603, 604], [12, EOS], [31, 32, 33, 34, 35, 36, 37]]
    advantages = [0.7071, -0.7071, -0.7071, 0.7071, 1.0, -1.0, -0.5, 0.5]
    return UpdateBatch([prompts[g // 2 % 2] for g in range(8)], completions, advantages,
                       [g // 2 for g in range(8)])


def update_equivalence(model_dir: str, out: str) -> None:
    from grpogate.config import load_config
    from grpogate.distributed import SINGLE, close_world, init_world
    from grpogate.inputs.policy import load_policy, reference_mode, trainable_parameters
    from grpogate.inputs.tasks import Problem, prompt_id
    from grpogate.sampling.rollout import encode_prompts
    from grpogate.training.update import UpdateSettings, grpo_update

    world = init_world()
    config = load_config("smoke", overrides=["device=\"cpu\"", "dtype=\"float32\"", "lora_r=4"],
                         model=model_dir, out="/nonexistent")
    policy = load_policy(config, seed=0)
    questions = ["What is 3 + 4?", "What is 12 + 30?"]
    problems = [Problem(prompt_id(q), q, "7", f"test:{i}") for i, q in enumerate(questions)]
    batch = fixed_batch(encode_prompts(policy.tokenizer, problems, "Answer.", 192))
    parameters = trainable_parameters(policy)
    start = {name: p.detach().clone() for name, p in parameters.items()}

    def updated(overrides: dict, in_world):
        with torch.no_grad():
            for name, parameter in parameters.items():
                parameter.copy_(start[name])
        optimizer = torch.optim.AdamW(parameters.values(), lr=1e-3, weight_decay=0.0)
        settings = UpdateSettings(**{"micro_batch_size": 2, "temperature": 1.0,
                                     "max_new_tokens": 8, "beta": 0.0, **overrides})
        record = grpo_update(policy.model, optimizer, batch, settings, EOS,
                             lambda: reference_mode(policy), parameters.values(), world=in_world)
        return {n: p.detach().clone() for n, p in parameters.items()}, record

    results = {}
    for name, overrides in VARIANTS:
        sharded, record = updated(overrides, world)
        digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in sharded.values())).hexdigest()
        digests = world.all_gather_object(digest)
        if world.is_main:
            alone, alone_record = updated(overrides, SINGLE)
            results[name] = {
                "max_abs_difference": max(float((sharded[n] - alone[n]).abs().max()) for n in alone),
                "max_abs_change": max(float((alone[n] - start[n]).abs().max()) for n in alone),
                "ranks_agree": len(set(digests)) == 1,
                "tokens": [record.tokens, alone_record.tokens],
                "sequences": [record.sequences, alone_record.sequences],
                "update_count": [record.update_count, alone_record.update_count],
                "loss": [record.losses, alone_record.losses]}
    if world.is_main:
        with open(out, "w") as stream:
            json.dump(results, stream)
    close_world(world)


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run_cli(sys.argv[2:])
    else:
        update_equivalence(sys.argv[2], sys.argv[3])
