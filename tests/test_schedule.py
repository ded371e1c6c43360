"""The learning-rate schedule: hand-computed factors, the config's checks, and a run that trains
at the scheduled rate in every step and records it."""

from __future__ import annotations

import math

import pytest
from helpers import alternating_rewards

from grpogate import pipeline
from grpogate.config import load_config
from grpogate.errors import InputError
from grpogate.training import loop as training
from grpogate.training.schedule import rate_factor, warmup_steps


def test_constant_ignores_the_warmup_as_transformers_does():
    assert [rate_factor(s, 4, "constant", 0.5) for s in range(4)] == [1.0] * 4


def test_warmup_is_ceil_of_the_ratio_and_starts_at_zero():
    # ceil(0.1 x 16) = ceil(1.6) = 2 warmup steps: factors 0/2, 1/2, then 1.
    assert warmup_steps(16, 0.1) == 2
    assert [rate_factor(s, 16, "constant_with_warmup", 0.1)
            for s in range(4)] == [0.0, 0.5, 1.0, 1.0]


def test_linear_decays_to_one_step_above_zero():
    # 4 steps, no warmup: (4 - s) / 4 = 1, 0.75, 0.5, 0.25.
    assert [rate_factor(s, 4, "linear") for s in range(4)] == [1.0, 0.75, 0.5, 0.25]
    # With warmup_ratio 0.25: W = 1; step 0 -> 0, then (4 - s) / (4 - 1) = 1, 2/3, 1/3.
    assert [rate_factor(s, 4, "linear", 0.25) for s in range(4)] == pytest.approx(
        [0.0, 1.0, 2 / 3, 1 / 3])


def test_cosine_is_a_half_cosine_after_the_warmup():
    # 4 steps, W = 1: progress (s - 1) / 3 = 0, 1/3, 2/3 -> (1 + cos(pi p)) / 2 = 1, 0.75, 0.25.
    assert [rate_factor(s, 4, "cosine", 0.25) for s in range(4)] == pytest.approx(
        [0.0, 1.0, 0.75, 0.25])
    # No warmup, 64 steps: step 32 is halfway, cos(pi / 2) = 0 -> 0.5;
    # step 63: (1 + cos(63 pi / 64)) / 2 = (1 - 0.998795) / 2 = 0.000602.
    assert rate_factor(32, 64, "cosine") == pytest.approx(0.5)
    assert rate_factor(63, 64, "cosine") == pytest.approx((1 + math.cos(63 * math.pi / 64)) / 2)
    assert rate_factor(63, 64, "cosine") == pytest.approx(0.000602, abs=1e-6)


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        rate_factor(0, 4, "polynomial")


@pytest.mark.parametrize("setting, message", [
    ("lr_scheduler_type='polynomial'", "lr_scheduler_type must be one of constant"),
    ("warmup_ratio=1.0", r"warmup_ratio must be in \[0, 1\)"),
    ("warmup_ratio=-0.1", r"warmup_ratio must be in \[0, 1\)"),
])
def test_bad_schedule_settings_are_refused(setting, message):
    with pytest.raises(InputError, match=message):
        load_config("default", overrides=[setting])


def test_a_run_trains_each_step_at_its_scheduled_rate(tiny_config, tmp_path, monkeypatch):
    config = tiny_config(tmp_path, train_prompts=8, lr_scheduler_type="cosine", warmup_ratio=0.25,
                         learning_rate=1e-3)
    assert config.steps == 4
    seen = []
    real_update = training.update_with_retry

    def spy(model, optimizer, *args, **kwargs):
        seen.append([group["lr"] for group in optimizer.param_groups])
        return real_update(model, optimizer, *args, **kwargs)

    monkeypatch.setattr(training, "score_completions", alternating_rewards)
    monkeypatch.setattr(training, "update_with_retry", spy)
    evidence = pipeline.run(config)
    # 1e-3 x (0, 1, 0.75, 0.25), the cosine factors above.
    expected = [0.0, 1e-3, 0.75e-3, 0.25e-3]
    assert [rates[0] for rates in seen] == pytest.approx(expected)
    assert all(len(set(rates)) == 1 for rates in seen)
    assert [s["learning_rate"] for s in evidence["steps"]] == pytest.approx(expected)
    update = evidence["update"]
    assert (update["lr_scheduler_type"], update["warmup_ratio"]) == ("cosine", 0.25)
    assert update["last_learning_rate"] == pytest.approx(0.25e-3)
