"""The GPU check: a random-weight model of Qwen2.5-0.5B-Instruct's shape through the whole
pipeline at the reference profile's sizes (docs/design.md §13), recording seconds per stage, generation tokens/s, effective
trajectories/s and peak allocated / reserved GPU memory next to the published 7.0 / 9.5 GiB;
then `grpogate gate --candidate` on the adapter that run delivered (the door a candidate from
another trainer takes), with its own decision, tokens/s and peak memory.

    python bench/gpu_check.py --tokenizer DIR --gsm8k DIR --out DIR [--tiny]

No model can be downloaded on the device machine, so the model is built from a config (Qwen2,
hidden 896, 24 layers, 14 heads / 2 KV heads, vocabulary 151,936) with random weights; the
tokenizer is any local one (the bundled SmolLM2 tokenizer works: ids it does not know decode to
nothing). Quality means nothing with random weights, so the training verifier is replaced by a
fixed pattern (even samples 1, odd 0): every group is valid and every optimizer step runs, as
on a run that learns. The re-test keeps the real GSM8K verifier. Speed and memory are real.

`--tiny` shrinks the model and the sizes so the script itself can be tested on a CPU.
Prints one JSON object; the run directory holds the usual evidence.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=151936, max_position_embeddings=2048,
            tie_word_embeddings=True)
# dtype=auto: the GPU run's bfloat16 where the CPU has bf16 kernels, float32 elsewhere (emulated
# bfloat16 made the tiny CPU run several times slower and tests nothing the GPU run needs).
TINY_SIZES = ["train_prompts=4", "prompts_per_step=4", "eval_prompts=2", "max_new_tokens=8",
              "generation_batch_size=32", "dtype=auto"]
PUBLISHED_GIB = {"peak_allocated": 7.0, "peak_reserved": 9.5}


def alternating_rewards(completions, problems, verifier) -> list[float]:
    return [1.0 if c.sample_index % 2 == 0 else 0.0 for c in completions]


def build_model(directory: Path, tokenizer_dir: str, tiny: bool) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(**(TINY if tiny else QWEN25_05B), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a local tokenizer directory")
    parser.add_argument("--gsm8k", required=True, help="directory with train.jsonl and test.jsonl")
    parser.add_argument("--out", required=True, help="a new directory for the model and the run")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model and 4 prompts (CPU)")
    args = parser.parse_args()

    import torch

    from grpogate import pipeline
    from grpogate.training import loop as training
    from grpogate.config import load_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=False)
    started = time.perf_counter()
    build_model(out / "model", args.tokenizer, args.tiny)
    build_seconds = time.perf_counter() - started
    overrides = [f"task.path={args.gsm8k}", "device=auto"] + (TINY_SIZES if args.tiny else [])
    config = load_config("gsm8k_qwen05b", overrides=overrides, model=str(out / "model"),
                         out=str(out / "run"))
    training.score_completions = alternating_rewards  # forced reward signal: see the docstring
    started = time.perf_counter()
    evidence = pipeline.run(config)
    wall = time.perf_counter() - started
    resources, rollout = evidence["resources"], evidence["rollout"]
    gib = 1024 ** 3
    gated = gate_candidate(config, out)
    print(json.dumps({
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "tiny": args.tiny, "model_build_seconds": round(build_seconds, 1),
        "run_wall_seconds": round(wall, 1), "stage_seconds": evidence["timings"],
        "steps": len(evidence["steps"]), "update_count": evidence["update"]["update_count"],
        "generated_tokens": rollout["generated_tokens"],
        "generation_tokens_per_second": rollout["generation_tokens_per_second"],
        "decode_paths": rollout["decode_paths"],
        "max_length_hit_ratio": rollout["max_length_hit_ratio"],
        "effective_trajectories_per_second": evidence["effective_trajectories_per_second"],
        "peak_allocated_gib": resources["peak_allocated_bytes"] / gib,
        "peak_reserved_gib": resources["peak_reserved_bytes"] / gib,
        "published_gib": PUBLISHED_GIB, "decision": evidence["decision"]["decision"],
        "run_dir": evidence["run_dir"], "gate_candidate": gated,
    }, indent=2))


def gate_candidate(config, out: Path) -> dict:
    """`grpogate gate --candidate RUN/adapter` against the same baseline, as a user gating
    another trainer's adapter would (the run's own train split is what it trained on)."""
    import torch

    from grpogate.trl_gate import GateRequest, gate

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    config = dataclasses.replace(config, out=str(out / "gate"))
    started = time.perf_counter()
    evidence = gate(config, GateRequest(candidate=str(out / "run" / "adapter"),
                                        train_from_config=True))
    run_dir, seconds = Path(evidence["run_dir"]), evidence["timings"]["evaluation_seconds"]
    records = [json.loads(line) for name in ("eval_completions.jsonl", "guard_completions.jsonl")
               if (run_dir / name).is_file()
               for line in (run_dir / name).read_text().splitlines()]
    tokens = sum(record["completion_tokens"] for record in records)
    return {"wall_seconds": round(time.perf_counter() - started, 1),
            "decision": evidence["decision"]["decision"],
            "failed_checks": evidence["decision"]["failed_checks"],
            "retest_completions": len(records),
            "retest_tokens_per_second": tokens / seconds if seconds else None,
            "peak_allocated_gib": evidence["resources"]["peak_allocated_bytes"] / 1024 ** 3,
            "run_dir": str(run_dir)}


if __name__ == "__main__":
    main()
