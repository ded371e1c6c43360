"""TRL's GRPOTrainer on the benchmark's shared workload, instrumented from the outside.

Nothing in TRL's algorithm is changed. Two thin hooks measure what the table needs:
`_generate_single_turn` is timed (generation seconds and completion tokens, EOS included, the
same count grpogate records), and a callback times each optimizer step from `on_step_begin` to
`on_step_end` (generation + reward + forward/backward + optimizer, like grpogate's step). The
reward function calls grpogate's verifier and keeps the rewards it saw, so valid groups are
counted exactly as grpogate counts them (rewards of a prompt's G completions not all equal).
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from pathlib import Path


def trl_arguments(settings: dict, out_dir: Path, gradient_checkpointing: bool):
    """GRPOConfig for one step = prompts_per_step x G completions, one generation, one update."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out_dir / "trainer"), num_generations=settings["group_size"],
        # TRL's batch counts completions: prompts x G per device step, one generation per step
        # (steps_per_generation = gradient_accumulation_steps = 1) and one update per rollout.
        per_device_train_batch_size=settings["prompts_per_step"] * settings["group_size"],
        gradient_accumulation_steps=1, num_iterations=1,
        max_completion_length=settings["max_new_tokens"], learning_rate=settings["learning_rate"],
        # grpogate's optimizer has no schedule: a constant rate keeps "same learning rate" true
        # (TRL's default linear decay would average half the rate over the run).
        lr_scheduler_type="constant", beta=0.0, temperature=1.0, top_p=1.0,
        logging_steps=1, report_to=[], use_cpu=True, bf16=False,
        gradient_checkpointing=gradient_checkpointing, max_steps=settings["steps"],
        # No shuffle: step k trains on train prompts [k * P, (k + 1) * P), exactly as grpogate.
        save_strategy="no", shuffle_dataset=False, seed=settings["seed"], disable_tqdm=True,
        model_init_kwargs={"dtype": "float32"})


def valid_groups(pairs: list[tuple[str, float]]) -> tuple[int, int]:
    """(groups whose rewards differ, all groups) from one step's (prompt_id, reward) pairs."""
    by_prompt: dict[str, list[float]] = {}
    for prompt_id, reward in pairs:
        by_prompt.setdefault(prompt_id, []).append(reward)
    return sum(max(r) > min(r) for r in by_prompt.values()), len(by_prompt)


def _checkpointing_active(model) -> bool | None:
    """Whether the trained model really recomputed activations (the flag's effect, not the flag)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        value = getattr(type(base), name, None)
        if value is not None:
            return bool(getattr(base, name))
    return None


def run_trl(config, train: list, load_dir: str, settings: dict, out_dir: Path,
            gradient_checkpointing: bool, name: str) -> dict:
    """Train with TRL on `train` (in order), save the adapter, return per-step measurements."""
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback

    from grpogate.sampling.rollout import encode_prompts
    from grpogate.inputs.verifiers import get_verifier

    group_size, per_step = settings["group_size"], settings["prompts_per_step"]
    system_prompt = config.resolved_system_prompt()
    dataset = Dataset.from_list([
        {"prompt": [{"role": "system", "content": system_prompt},
                    {"role": "user", "content": problem.question}],
         "reference": problem.reference, "prompt_id": problem.prompt_id} for problem in train])
    verifier = get_verifier(config.resolved_verifier())
    reward_batches: list[list[tuple[str, float]]] = []  # one per generation, i.e. per step

    def chain_sum_reward(completions, reference, prompt_id, **_):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        rewards = [verifier.score(text, ref) for text, ref in zip(texts, reference)]
        reward_batches.append(list(zip(prompt_id, rewards)))
        return rewards

    generations: list[dict] = []

    class TimedGRPOTrainer(trl.GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            started = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            generations.append({"seconds": time.perf_counter() - started,
                                "tokens": sum(len(ids) for ids in completion_ids),
                                "prompt_ids": [tuple(ids) for ids in prompt_ids]})
            return completion_ids, logprobs

    step_seconds: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_seconds.append(time.perf_counter() - self.started)
            print(f"[{name}] step {state.global_step}/{args.max_steps}: {step_seconds[-1]:.1f} s",
                  file=sys.stderr, flush=True)

    args = trl_arguments(settings, out_dir, gradient_checkpointing)
    tokenizer = AutoTokenizer.from_pretrained(load_dir)
    lora = LoraConfig(r=settings["lora_r"], lora_alpha=settings["lora_alpha"], lora_dropout=0.0,
                      target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = TimedGRPOTrainer(model=load_dir, reward_funcs=[chain_sum_reward], args=args,
                               train_dataset=dataset, processing_class=tokenizer, peft_config=lora,
                               callbacks=[StepTimer()])
    trainer.train()
    checkpointing_active = _checkpointing_active(trainer.model)
    training_peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    adapter = out_dir / "adapter"
    trainer.save_model(str(adapter))

    steps_run = settings["steps"]
    if not len(step_seconds) == len(generations) == len(reward_batches) == steps_run:
        raise RuntimeError(f"{name}: expected one generation and one reward call per step, got "
                           f"{len(step_seconds)} steps, {len(generations)} generations, "
                           f"{len(reward_batches)} reward calls")
    # Same prompts, same tokens: TRL's prompt token ids of step k must be grpogate's encoding
    # of train prompts [k * P, (k + 1) * P), each G times.
    expected = encode_prompts(tokenizer, train, system_prompt, config.max_prompt_tokens)
    prompts_match = all(
        sorted(g["prompt_ids"]) == sorted(tuple(ids) for ids in expected[k * per_step:(k + 1) * per_step]
                                          for _ in range(group_size))
        for k, g in enumerate(generations))
    logged = [entry for entry in trainer.state.log_history if "frac_reward_zero_std" in entry]
    steps = []
    for k in range(steps_run):
        valid, groups = valid_groups(reward_batches[k])
        steps.append({"step": k, "seconds": step_seconds[k],
                      "generation_seconds": generations[k]["seconds"],
                      # everything of the step but generation: reward, forwards, backward, optimizer
                      "update_seconds": step_seconds[k] - generations[k]["seconds"],
                      "generated_tokens": generations[k]["tokens"], "valid_group_count": valid,
                      "group_count": groups,
                      "mean_reward": statistics.fmean(r for _, r in reward_batches[k]),
                      # TRL's own count, a cross-check of valid_group_count / group_count.
                      "trl_frac_reward_zero_std": logged[k]["frac_reward_zero_std"] if k < len(logged) else None})
    effective = sum(st["valid_group_count"] for st in steps) * group_size
    generation_seconds = sum(st["generation_seconds"] for st in steps)
    train_seconds = sum(st["seconds"] for st in steps)
    return {
        "system": name, "trl_version": trl.__version__,
        "gradient_checkpointing": gradient_checkpointing,
        "checkpointing_active_in_model": checkpointing_active, "loss_type": args.loss_type,
        "scale_rewards": args.scale_rewards, "steps": steps,
        "generation_tokens_per_second": (sum(st["generated_tokens"] for st in steps) / generation_seconds
                                         if generation_seconds > 0 else 0.0),
        # docs/design.md §3's definition, with TRL's whole step (it has no separate stage timers).
        "effective_trajectories_per_second": effective / train_seconds if train_seconds > 0 else 0.0,
        "effective_trajectory_count": effective,
        "peak_rss_bytes": training_peak_rss, "adapter": str(adapter),
        "prompt_tokens_match_grpogate": prompts_match, "torch_threads": torch.get_num_threads(),
    }
