"""The dry run's cost figures: the expected peak memory's arithmetic and the time forecast's
count of products, on small shapes worked out by hand, and the measurement's shape."""

import dataclasses

import pytest
import torch

from grpogate.config import RunConfig
from grpogate.config.schema import GuardConfig
from grpogate import forecast
from grpogate.inputs import budget

# 2 layers, hidden 8, 2 heads of 4 (1 KV head), MLP 16, vocabulary 10, tied embeddings.
DIMS = {"hidden": 8, "layers": 2, "heads": 2, "kv_heads": 1, "head_dim": 4, "intermediate": 16,
        "vocab": 10, "context": 0, "tied": True}
PROMPT = {"shared": 3, "own": 2}


def small_config(**changes) -> RunConfig:
    config = RunConfig(train_prompts=4, prompts_per_step=2, group_size=4, generation_batch_size=8,
                       max_new_tokens=5, eval_prompts=2, eval_batch_prompts=2, eval_group_size=2,
                       micro_batch_size=8, lora_r=2, guard=GuardConfig(prompts=0))
    return dataclasses.replace(config, **changes)


def test_the_expected_peak_adds_runtime_weights_adapter_training_and_re_test():
    # weights: per layer q 8x8, k and v 8x4 each, o 8x8 (192) + MLP 3 x 8x16 (384) = 576; two
    # layers 1152 + tied embeddings 10x8 = 1232 parameters x 2 bytes x 4 copies = 9856.
    # LoRA r=2 on 7 maps of a layer: 2 x (16+12+12+16+24+24+24) = 256, two layers 512, x 16
    # bytes (weights, gradients, two AdamW moments, float32) = 8192.
    # KV per token 2 layers x 2 x 1 head x 4 x 2 bytes = 32; a logits row 10 x 4 x 2 = 80.
    # rollout: 2 prompts x 4 rows: (3 + 2 x (2 + 4x5)) x 32 + 8 x 80 = 2144;
    # update: 1 valid group (2 x 0.5): 3 + 2 + 4 rows x 5 x 0.5 = 15 tokens x 2 layers x 2
    #   bytes x (6x8 + 4x16 = 112 values) = 6720, and what the allocator keeps over 2 steps,
    #   x (1 + 2 x 0.076) = 7741.44, the larger of the two;
    # re-test: 2 prompts x 2 rows, two policies: 2 x ((3 + 2 x (2 + 2x5)) x 32 + 4 x 80) = 2368.
    parts = budget.expected_peak(small_config(), DIMS, 2, PROMPT, runtime_bytes=1000,
                                 completion_fraction=0.5, valid_fraction=0.5)
    assert parts == {"runtime": 1000, "weights": 9856, "adapter and optimizer": 8192,
                     "update tensors": 7741, "re-test tensors": 2368, "total": 29157}


def test_the_rollout_is_the_training_stage_held_when_its_logits_are_larger():
    # Vocabulary 1000, weights held once (the reference engine): (1152 + 1000 x 8) x 2 = 18304;
    # a logits row 8000 bytes. rollout: 1504 of KV + 8 rows x 8000 = 65504 > the update's 7741;
    # re-test: 2 x (864 + 4 x 8000) = 65728.
    parts = budget.expected_peak(small_config(), dict(DIMS, vocab=1000), 2, PROMPT,
                                 runtime_bytes=0, completion_fraction=0.5, valid_fraction=0.5,
                                 weight_copies=1)
    assert parts == {"runtime": 0, "weights": 18304, "adapter and optimizer": 8192,
                     "rollout tensors": 65504, "re-test tensors": 65728, "total": 157728}


def test_what_the_allocator_keeps_stops_growing_after_its_steps():
    # 100 steps count as 40: 6720 x (1 + 40 x 0.076) = 27148.8.
    parts = budget.expected_peak(small_config(train_prompts=200), DIMS, 2, PROMPT,
                                 runtime_bytes=0, completion_fraction=0.5, valid_fraction=0.5)
    assert parts["update tensors"] == 27148


RATES = {"device": "cpu", "step_fixed": 0.5, "step_per_row": 0.01, "per_token": 0.001,
         "cast_per_byte": 1e-6, "hash_per_byte": 1e-6, "start": 1.0}


def test_the_time_forecast_counts_each_stages_products(monkeypatch):
    monkeypatch.setattr(forecast, "STAGE_PRODUCT_SHARE", {"rollout": 1, "update": 1, "retest": 1})
    monkeypatch.setattr(forecast, "UPPER_SLOWDOWN", 1.0)
    monkeypatch.setattr(forecast, "STEP_WEIGHT_PASSES", {"rollout": 0.0, "update": 0.0})
    monkeypatch.setattr(forecast, "LOAD_WEIGHT_PASSES", 2.0)
    monkeypatch.setattr(forecast, "CHECKPOINT_HASH_PASSES", 1.0)
    monkeypatch.setattr(forecast, "FINISH_SECONDS", 0.0)
    monkeypatch.setattr(forecast, "RECORD_SECONDS", 0.0)
    config = small_config(beta=0.04)
    seconds = forecast.workload_seconds(config, RATES, PROMPT, weight_bytes=1000,
                                        checkpoint_bytes=100, upper=True)
    # Upper: completions to 5 tokens, every group valid, the re-test at its maximum (2 prompts).
    # rollout, per step: one batch of 2 prompts x 4 rows; prefill 3 + 2x2 = 7 tokens x 0.001,
    #   4 decode steps x 0.5 + 8 rows x 4 steps x 0.01 = 2.327; 2 steps: 4.654.
    # update, per step: 3 + 2x2 + 8 x 5 = 47 tokens x 3 passes (reference, forward, backward)
    #   x 0.001 = 0.141; 2 steps: 0.282.
    # re-test: one batch of 2 prompts x 2 rows: 0.007 + 2.0 + 4 x 4 x 0.01 = 2.167, three
    #   decodes (baseline, candidate, the baseline in lockstep) = 6.501.
    # load 2 x 1000 x 1e-6 = 0.002; checkpoints 2 steps x 100 x 1e-6; start 1.0.
    assert seconds == {"load": 0.0, "rollout": 4.7, "update": 0.3, "retest": 6.5,
                       "checkpoints": 0.0, "start and finish": 1.0, "total": 12.4}


def test_the_expected_forecast_thins_rows_and_skips_invalid_groups(monkeypatch):
    monkeypatch.setattr(forecast, "STAGE_PRODUCT_SHARE", {"rollout": 1, "update": 1, "retest": 1})
    monkeypatch.setattr(forecast, "PLANNING", dict(forecast.PLANNING, completion_fraction=0.5,
                                                   valid_group_fraction=0.5))
    monkeypatch.setattr(forecast, "STEP_WEIGHT_PASSES", {"rollout": 1.0, "update": 0.0})
    config = small_config(beta=0.0)
    seconds = forecast.workload_seconds(config, RATES, PROMPT, weight_bytes=1000,
                                        checkpoint_bytes=0, upper=False)
    # rollout, per step: 0.007 + 2.0 + 8 rows x 4 steps x 0.5 x 0.01 = 2.167, and one pass over
    # 1000 weight bytes at 1e-6 s a byte, 0.001; 2 steps 4.336.
    # update, per step: 1 valid group: 3 + 2 + 4 x 5 x 0.5 = 15 tokens x 2 passes x 0.001 = 0.03.
    assert seconds["rollout"] == 4.3
    assert seconds["update"] == 0.1  # 0.06, rounded to a tenth


def test_the_default_re_test_is_expected_to_stop_before_its_maximum():
    config = RunConfig()  # the default: 256 eval prompts in looks of 32, 16 guard rounds
    planned = forecast.expected_retest(config)
    assert planned["most"] == (256, 16)
    # At probability 0.5 the reward gain (+0.28, spread 0.36) resolves by 64 prompts (0.186)
    # but the pass@4 gain (+0.23, spread 0.52) not before 96 (0.266 at 64, 0.205 at 96): both
    # gates at 96, seed 42's own stop. The guard's +0.23 against a margin of -0.05 (spread
    # 0.58) resolves in its first round of 200 paired samples (0.153 <= 0.28): the default's
    # three runs stopped the guard there.
    assert planned["expected"] == (96, 1)


def test_the_measurement_times_the_models_shapes():
    rates = forecast.measure_rates(DIMS, torch.float32, torch.device("cpu"), decode_rows=16,
                                   start=1.5, token_rows=32)
    assert rates["device"] == "cpu"
    assert rates["step_fixed"] >= 0 and rates["step_per_row"] >= 0
    assert 0 < rates["per_token"] < 0.01  # 2 tiny layers: microseconds per token
    assert rates["cast_per_byte"] > 0 and rates["hash_per_byte"] > 0
    assert rates["start"] == 1.5


if __name__ == "__main__":
    pytest.main([__file__])
