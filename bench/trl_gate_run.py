"""Train with TRL's GRPOTrainer on the benchmark's workload and save what `grpogate gate` reads.

    python bench/trl_gate_run.py --steps 4 --workdir runs/trl-gate
    grpogate gate --from-trl runs/trl-gate/trainer --trl-args runs/trl-gate/trl_args.json \
        --config runs/trl-gate/gate.toml --train-data runs/trl-gate/train.jsonl \
        --out runs/trl-gate/gated

The workload is grpo_vs_trl.py's (the bundled SmolLM2-135M-Instruct, chain_sum, the same train
prompts in order, G, token budget, LoRA, constant learning rate, beta = 0), TRL in float32.
Nothing of TRL is changed; the script only saves the output directory a TRL user would have:
`trainer.save_model()` (the PEFT adapter) and `trainer.save_state()` (trainer_state.json with
its log and train_runtime), plus the training dataset as JSONL, the GRPOConfig as JSON
(`args.to_json_string()`) and the grpogate config of the re-test (gate.toml).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpo_vs_trl  # noqa: E402 (bench/ on the path)
import trl_side  # noqa: E402

GATE_KEYS = ("train_prompts", "prompts_per_step", "group_size", "max_new_tokens", "eval_prompts",
             "eval_group_size", "temperature", "top_p", "seed", "model", "dtype", "lora_r",
             "lora_alpha", "learning_rate", "beta")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    if workdir.exists():
        raise SystemExit(f"{workdir}: already exists")
    defaults = vars(grpo_vs_trl.parse_args([]))
    settings = {key: defaults[key] for key in (
        "prompts_per_step", "group_size", "max_new_tokens", "eval_prompts", "eval_samples",
        "learning_rate", "lora_r", "lora_alpha", "seed", "model")} | {"steps": args.steps}
    spec = {"settings": settings, "grpogate_set": ["dtype=\"float32\""]}
    config = grpo_vs_trl.build_config(spec)
    train, _, _ = grpo_vs_trl.problem_sets(config)
    workdir.mkdir(parents=True)
    system_prompt = config.resolved_system_prompt()
    (workdir / "train.jsonl").write_text("".join(json.dumps({
        "prompt": [{"role": "system", "content": system_prompt},
                   {"role": "user", "content": p.question}],
        "reference": p.reference}) + "\n" for p in train), encoding="utf-8")
    gate = {key: getattr(config, key) for key in GATE_KEYS}
    task = config.task
    lines = [f"{key} = {json.dumps(value)}" for key, value in gate.items()]
    lines += ["[task]", f"source = {json.dumps(task.source)}", f"name = {json.dumps(task.name)}",
              "[task.params]"] + [f"{k} = {json.dumps(v)}" for k, v in task.params.items()]
    (workdir / "gate.toml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = train_and_save(config, train, settings, workdir)
    print(json.dumps(result, indent=2))
    return 0


def train_and_save(config, train: list, settings: dict, workdir: Path) -> dict:
    """trl_side's trainer and arguments, saving the adapter and the state into output_dir."""
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from grpogate.inputs.verifiers import get_verifier

    verifier = get_verifier(config.resolved_verifier())
    dataset = Dataset.from_list([json.loads(line) for line in
                                 (workdir / "train.jsonl").read_text().splitlines()])

    def chain_sum_reward(completions, reference, **_):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [verifier.score(text, ref) for text, ref in zip(texts, reference)]

    load_dir = grpo_vs_trl.resolve_load_dir(config)
    arguments = trl_side.trl_arguments(settings, workdir, gradient_checkpointing=False)
    (workdir / "trl_args.json").write_text(arguments.to_json_string(), encoding="utf-8")
    lora = LoraConfig(r=settings["lora_r"], lora_alpha=settings["lora_alpha"], lora_dropout=0.0,
                      target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = trl.GRPOTrainer(model=load_dir, reward_funcs=[chain_sum_reward], args=arguments,
                              train_dataset=dataset,
                              processing_class=AutoTokenizer.from_pretrained(load_dir),
                              peft_config=lora)
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    logged = [e for e in trainer.state.log_history if "frac_reward_zero_std" in e]
    return {"trl_version": trl.__version__, "output_dir": arguments.output_dir,
            "steps": [{k: e.get(k) for k in ("step", "reward", "frac_reward_zero_std",
                                             "completions/clipped_ratio", "step_time")}
                      for e in logged],
            "train_runtime": next((e["train_runtime"] for e in trainer.state.log_history
                                   if "train_runtime" in e), None)}


if __name__ == "__main__":
    raise SystemExit(main())
