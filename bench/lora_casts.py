"""Dtype copies PEFT's LoRA path adds to one forward, per model dtype (torch profiler counts).

    python bench/lora_casts.py --model DIR [--dtypes float32,bfloat16]

Counts `aten::_to_copy` in one forward of a [2, 40] batch with the adapter on and off, and how
many of the extra copies are on 0-dim tensors (scalars) rather than activations.
"""

from __future__ import annotations

import argparse
import contextlib
import json


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from grpogate.config import load_config
    from grpogate.inputs.policy import load_policy

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    result = {}
    for dtype in args.dtypes.split(","):
        config = load_config("smoke", model=args.model, overrides=[f'dtype="{dtype}"', 'device="cpu"'])
        policy = load_policy(config, seed=0)
        ids = torch.randint(100, 1000, (2, 40))
        counts = {}
        for label, mode in (("adapter_on", contextlib.nullcontext), ("adapter_off", policy.model.disable_adapter)):
            with mode(), torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                policy.model(input_ids=ids)
            copies = [e for e in prof.events() if e.name == "aten::_to_copy"]
            counts[label] = {"copies": len(copies),
                             "scalar_copies": sum(1 for e in copies if e.input_shapes and e.input_shapes[0] == [])}
        counts["lora_layers"] = sum(1 for name, _ in policy.model.named_modules() if name.endswith(".lora_A"))
        result[dtype] = counts
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
