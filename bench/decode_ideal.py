"""The machine's ideal decode speed for one model: its decode-step matrix products alone.

One decode step of a batch of B sequences multiplies a [B, in] activation by every linear weight
of the model (all layers' q, k, v, o, gate, up, down and the LM head). Timing just those products,
with no attention, sampling or framework code around them, gives the tokens/s that generation
could reach on this CPU if everything else were free; generation tokens/s divided by it is the
generation peak fraction.

    python bench/decode_ideal.py [--batch-size 64] [--threads N]   # prints the ideal as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import time


def linear_shapes(load_dir: str) -> list[tuple[int, int]]:
    """(in, out) of every nn.Linear in module order: all layers' projections, then the LM head.

    Built on the meta device from the model's config: real shapes, no weights loaded.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(load_dir))
    return [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def bf16_supported() -> bool:
    """oneDNN bfloat16 kernels (avx512_bf16 / AMX on x86): bfloat16 is then a fast CPU dtype."""
    import torch

    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def decode_step_tokens_per_second(shapes: list[tuple[int, int]], batch_size: int, dtype,
                                  round_seconds: float = 1.0, rounds: int = 5) -> dict:
    """Ideal decode tokens/s = batch_size / seconds of one pass over every linear map.

    After a warm-up, `rounds` rounds of many passes are timed and the best round counts: noise
    from other processes only ever slows a round down, so the minimum is the machine's ideal.
    """
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(out, inp, generator=generator) * 0.02).to(dtype) for inp, out in shapes]
    inputs = {inp: torch.randn(batch_size, inp, generator=generator).to(dtype) for inp, _ in shapes}
    pairs = [(inputs[w.shape[1]], w) for w in weights]  # x [B, in] @ w[out, in].T -> [B, out]

    def one_step():
        for x, w in pairs:
            F.linear(x, w)

    with torch.inference_mode():
        for _ in range(3):
            one_step()
        started = time.perf_counter()
        one_step()
        repeats = max(3, int(round_seconds / max(time.perf_counter() - started, 1e-6)))
        best = float("inf")
        for _ in range(rounds):
            started = time.perf_counter()
            for _ in range(repeats):
                one_step()
            best = min(best, (time.perf_counter() - started) / repeats)
    return {"dtype": str(dtype).removeprefix("torch."), "batch_size": batch_size,
            "linear_maps": len(shapes), "seconds_per_decode_step": best,
            "tokens_per_second": batch_size / best, "repeats_per_round": repeats, "rounds": rounds}


def measure_ideal(load_dir: str, batch_size: int, threads: int, round_seconds: float = 1.0) -> dict:
    """Time float32 and, where the CPU has bfloat16 kernels, bfloat16; the faster is the ideal."""
    import torch

    torch.set_num_threads(threads)
    shapes = linear_shapes(load_dir)
    measured = [decode_step_tokens_per_second(shapes, batch_size, torch.float32, round_seconds)]
    if bf16_supported():
        measured.append(decode_step_tokens_per_second(shapes, batch_size, torch.bfloat16, round_seconds))
    best = max(measured, key=lambda m: m["tokens_per_second"])
    return {**best, "by_dtype": {m["dtype"]: m for m in measured},
            "bf16_supported": bf16_supported(), "threads": threads}


def fastest(*measured: dict) -> dict:
    """Several timings of the same ideal -> the fastest, with every timing's tokens/s kept.

    Other work on the machine only ever slows a timing down, so the fastest is the closest to
    the machine's ideal, and the peak fraction read against it is the conservative one.
    """
    best = max(measured, key=lambda m: m["tokens_per_second"])
    return {**best, "timings_tokens_per_second": [m["tokens_per_second"] for m in measured]}


def main() -> None:
    from grpogate.config import BUNDLED_MODEL, RunConfig
    from grpogate.policy import default_cache_dir, resolve_base_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=BUNDLED_MODEL)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--round-seconds", type=float, default=1.0)
    args = parser.parse_args()
    config = RunConfig(model=args.model)
    load_dir = resolve_base_model(config.model, "", default_cache_dir(config)).load_dir
    print(json.dumps(measure_ideal(load_dir, args.batch_size, args.threads, args.round_seconds), indent=2))


if __name__ == "__main__":
    main()
