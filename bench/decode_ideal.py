"""The machine's ideal decode speed for one model: its decode-step matrix products alone.

One decode step of a batch of B sequences multiplies a [B, in] activation by every linear weight
of the model (all layers' q, k, v, o, gate, up, down and the LM head). Timing just those products,
with no attention, sampling or framework code around them, gives the tokens/s that generation
could reach on this CPU if everything else were free; generation tokens/s divided by it is the
generation peak fraction. The products are timed with every kernel grpogate's decoder can use
(F.linear, and oneDNN on prepacked weights where the decoder prepacks them), and the fastest
counts: an ideal slower than the decoder's own kernels would flatter the fraction.

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


def decode_step_tokens_per_second(shapes: list[tuple[int, int]], batch_size: int, dtype,
                                  round_seconds: float = 1.0, rounds: int = 5,
                                  packed: bool = False) -> dict:
    """Ideal decode tokens/s = batch_size / seconds of one pass over every linear map.

    After a warm-up, `rounds` rounds of many passes are timed and the best round counts: noise
    from other processes only ever slows a round down, so the minimum is the machine's ideal.
    `packed`: the weights prepacked for oneDNN (grpogate.engines.cpu.weights.prepack), as the decoder runs them.
    """
    import torch

    from grpogate.engines.cpu.weights import linear, prepack

    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(out, inp, generator=generator) * 0.02).to(dtype) for inp, out in shapes]
    inputs = {inp: torch.randn(batch_size, inp, generator=generator).to(dtype) for inp, _ in shapes}
    pairs = [(inputs[w.shape[1]], prepack(w) if packed else w) for w in weights]  # [B, in] -> [B, out]

    def one_step():
        for x, w in pairs:
            linear(x, w, None)

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
            "kernel": "oneDNN prepacked" if packed else "F.linear",
            "linear_maps": len(shapes), "seconds_per_decode_step": best,
            "tokens_per_second": batch_size / best, "repeats_per_round": repeats, "rounds": rounds}


def measure_ideal(load_dir: str, batch_size: int, threads: int, round_seconds: float = 1.0) -> dict:
    """Time float32 with F.linear and (where `can_prepack` says the decoder prepacks it) with
    prepacked weights and, where the CPU has bfloat16 kernels, bfloat16 both ways; the fastest
    is the ideal. `by_dtype` keeps each dtype's fastest kernel."""
    import torch

    from grpogate.engines.cpu.weights import bf16_kernels_available, can_prepack

    torch.set_num_threads(threads)
    shapes = linear_shapes(load_dir)
    measured = [decode_step_tokens_per_second(shapes, batch_size, torch.float32, round_seconds)]
    if can_prepack(torch.zeros(1)):
        measured.append(decode_step_tokens_per_second(shapes, batch_size, torch.float32,
                                                      round_seconds, packed=True))
    bf16 = bf16_kernels_available()
    if bf16:
        measured.append(decode_step_tokens_per_second(shapes, batch_size, torch.bfloat16, round_seconds))
        if can_prepack(torch.zeros(1, dtype=torch.bfloat16)):
            measured.append(decode_step_tokens_per_second(shapes, batch_size, torch.bfloat16,
                                                          round_seconds, packed=True))
    best = max(measured, key=lambda m: m["tokens_per_second"])
    by_dtype = {}
    for m in sorted(measured, key=lambda m: m["tokens_per_second"]):
        by_dtype[m["dtype"]] = m  # the faster kernel of a dtype overwrites the slower
    return {**best, "by_dtype": by_dtype, "by_kernel": [
        {"dtype": m["dtype"], "kernel": m["kernel"], "tokens_per_second": m["tokens_per_second"]}
        for m in measured], "bf16_supported": bf16, "threads": threads}


def fastest(*measured: dict) -> dict:
    """Several timings of the same ideal -> the fastest, with every timing's tokens/s kept.

    Other work on the machine only ever slows a timing down, so the fastest is the closest to
    the machine's ideal, and the peak fraction read against it is the conservative one.
    """
    best = max(measured, key=lambda m: m["tokens_per_second"])
    return {**best, "timings_tokens_per_second": [m["tokens_per_second"] for m in measured]}


def main() -> None:
    from grpogate.config import BUNDLED_MODEL, RunConfig
    from grpogate.inputs.policy import default_cache_dir, resolve_base_model

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
