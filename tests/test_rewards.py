"""Reward components, their weighted total and both multi-objective aggregations, by hand."""

from __future__ import annotations

import math
import sys
import textwrap
import time

import pytest

from grpogate.config import RunConfig, load_config, validate
from grpogate.errors import InputError
from grpogate.inputs.rewards import (build_reward_set, format_reward, load_user_reward,
                                     soft_overlong_punishment)
from grpogate.training.advantages import ADVANTAGE_EPS, RewardComponents, build_update_batch

EPS = ADVANTAGE_EPS  # 1e-4, as TRL / verl


def reward_set(*specs, user_time_limit_seconds=1.0):
    return build_reward_set([{"name": n, "weight": w} for n, w in specs], "verifier-v1",
                            max_new_tokens=48, overlong_buffer_len=16,
                            overlong_penalty_factor=1.0,
                            user_time_limit_seconds=user_time_limit_seconds)


@pytest.mark.parametrize("tokens, expected", [
    (10, 0.0),      # below the buffer: 10 <= 48 - 16 = 32
    (32, 0.0),      # exactly at its start
    (40, -0.5),     # inside: (32 - 40) / 16 = -0.5
    (44, -0.75),    # inside: (32 - 44) / 16 = -0.75
    (48, -1.0),     # at the budget: (32 - 48) / 16 = -1
    (60, -1.0),     # beyond the budget: -penalty_factor
])
def test_soft_overlong_punishment_by_hand(tokens, expected):
    assert soft_overlong_punishment(tokens, max_new_tokens=48, buffer_len=16) == expected


def test_soft_overlong_punishment_scales_with_the_penalty_factor():
    # inside: (32 - 40) / 16 * 0.5 = -0.25; beyond: -0.5
    assert soft_overlong_punishment(40, max_new_tokens=48, buffer_len=16,
                                    penalty_factor=0.5) == -0.25
    assert soft_overlong_punishment(49, max_new_tokens=48, buffer_len=16,
                                    penalty_factor=0.5) == -0.5


@pytest.mark.parametrize("text, expected", [
    ("3 + 4 = 7\nAnswer: 7", 1.0), ("answer:  -12.5 ", 1.0), ("work\n#### 1,000\n\n", 1.0),
    ("Answer: 7 because", 0.0), ("The answer is 7.", 0.0), ("Answer: 7\nthanks", 0.0),
    ("", 0.0), (None, 0.0)])
def test_format_reward_reads_the_last_line(text, expected):
    assert format_reward(text) == expected


def test_weighted_total_of_three_components():
    rewards = reward_set(("correctness", 1.0), ("format", 0.5), ("overlong", 2.0))
    values = rewards.score("Answer: 7", "#### 7", 40, correctness=1.0)
    # format 1 (the line is "Answer: 7"), overlong (32 - 40) / 16 = -0.5
    assert values == {"correctness": 1.0, "format": 1.0, "overlong": -0.5}
    assert rewards.total(values) == 1.0 * 1.0 + 0.5 * 1.0 + 2.0 * -0.5  # = 0.5
    assert [d["name"] for d in rewards.describe()] == ["correctness", "format", "overlong"]
    assert rewards.versions["correctness"] == "verifier-v1"
    assert "buffer_len=16" in rewards.versions["overlong"]


# A group of 4 with 3 components, weights [1, 0.5, 1]:
#   correctness c = [1, 0, 0, 1], format f = [1, 1, 0, 0], overlong o = [0, -0.5, 0, -1]
GROUP = [[1.0, 1.0, 0.0], [0.0, 1.0, -0.5], [0.0, 0.0, 0.0], [1.0, 0.0, -1.0]]
WEIGHTS = [1.0, 0.5, 1.0]


def test_sum_then_normalize_by_hand():
    # totals t = c + 0.5 f + o = [1.5, 0, 0, 0]; mean 0.375; deviations [1.125, -0.375 x 3];
    # unbiased variance (1.265625 + 3 x 0.140625) / 3 = 0.5625, std 0.75.
    totals = [1.5, 0.0, 0.0, 0.0]
    batch = build_update_batch([[1]] * 4, [[2]] * 4, totals, 4, components=RewardComponents(
        values=GROUP, weights=WEIGHTS, aggregation="sum_then_normalize"))
    assert batch.advantages == pytest.approx(
        [1.125 / (0.75 + EPS), -0.375 / (0.75 + EPS), -0.375 / (0.75 + EPS),
         -0.375 / (0.75 + EPS)], abs=1e-12)


def test_normalize_then_sum_by_hand_normalizes_over_valid_groups_only():
    # Each component within the group (unbiased std):
    #   c: mean 0.5, deviations +-0.5, std sqrt(1/3)            -> c / (sqrt(1/3) + eps)
    #   f: the same, deviations [+.5, +.5, -.5, -.5]
    #   o: mean -0.375, deviations [.375, -.125, .375, -.625],
    #      variance (0.140625 + 0.015625 + 0.140625 + 0.390625) / 3 = 0.6875 / 3
    # s = nc + 0.5 nf + no, then over the batch (the valid group's 4 members; the second,
    # all-zero group is invalid and must not enter): (s - mean s) / (std s + eps).
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    std_o = math.sqrt(0.6875 / 3)
    no = [d / (std_o + EPS) for d in (0.375, -0.125, 0.375, -0.625)]
    s = [a + 0.5 * a + no[0], -a + 0.5 * a + no[1], -a - 0.5 * a + no[2], a - 0.5 * a + no[3]]
    mean = sum(s) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in s) / 3)
    expected = [(x - mean) / (std + EPS) for x in s]
    totals = [1.5, 0.0, 0.0, 0.0] + [0.0] * 4
    components = GROUP + [[0.0, 0.0, 0.0]] * 4
    batch = build_update_batch([[1]] * 8, [[2]] * 8, totals, 4, components=RewardComponents(
        values=components, weights=WEIGHTS, aggregation="normalize_then_sum"))
    assert batch.group_count == 1 and batch.advantages == pytest.approx(expected, abs=1e-12)
    # The two aggregations really differ here (else the test could not tell them apart).
    assert expected[1] != pytest.approx(-0.375 / (0.75 + EPS), abs=1e-3)


def test_masked_truncated_completions_keep_their_advantages():
    totals = [1.5, 0.0, 0.0, 0.0]
    plain = build_update_batch([[1]] * 4, [[2]] * 4, totals, 4)
    masked = build_update_batch([[1]] * 4, [[2]] * 4, totals, 4,
                                contributes=[True, False, True, False])
    assert masked.advantages == plain.advantages
    assert masked.contributes == [True, False, True, False] and masked.masked_count == 2
    # A valid group whose completions are all truncated trains nothing and is left out.
    assert len(build_update_batch([[1]] * 4, [[2]] * 4, totals, 4,
                                  contributes=[False] * 4)) == 0


USER_MODULE = '''
import time

def length_bonus(completion, reference):
    return len(completion) / 10

def slow(completion, reference):
    time.sleep(5)
    return 1.0

def broken(completion, reference):
    raise RuntimeError("boom")

def not_a_number(completion, reference):
    return float("nan")
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_12.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_12"
    sys.modules.pop("my_rewards_12", None)


def test_a_user_reward_is_versioned_by_its_source_and_its_failures_score_zero(user_module):
    rewards = reward_set(("correctness", 1.0), (f"{user_module}:length_bonus", 1.0),
                         (f"{user_module}:slow", 1.0), (f"{user_module}:broken", 1.0),
                         (f"{user_module}:not_a_number", 1.0), user_time_limit_seconds=0.2)
    started = time.perf_counter()
    values = rewards.score("abcde", "#### 1", 3, correctness=0.0)
    assert time.perf_counter() - started < 2.0  # the 5 s sleep was stopped at 0.2 s
    assert values == {"correctness": 0.0, f"{user_module}:length_bonus": 0.5,
                      f"{user_module}:slow": 0.0, f"{user_module}:broken": 0.0,
                      f"{user_module}:not_a_number": 0.0}
    assert rewards.error_count == 3
    _, version = load_user_reward(f"{user_module}:length_bonus")
    assert version.startswith(f"{user_module}:length_bonus@sha256:")
    with pytest.raises(ValueError, match="no function 'missing'"):
        load_user_reward(f"{user_module}:missing")
    with pytest.raises(ValueError, match="cannot import module"):
        load_user_reward("no_such_module_12:f")


def test_the_source_hash_changes_with_the_source(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    versions = []
    for body in ("return 1.0", "return 0.5"):
        (tmp_path / "edited_reward_12.py").write_text(f"def f(c, r):\n    {body}\n")
        sys.modules.pop("edited_reward_12", None)
        versions.append(load_user_reward("edited_reward_12:f")[1])
    sys.modules.pop("edited_reward_12", None)
    assert versions[0] != versions[1]


@pytest.mark.parametrize("override, message", [
    ('rewards=[{name = "speed", weight = 1.0}]', "rewards[0].name 'speed'"),
    ('rewards=[{name = "format", weight = inf}]', "rewards[0].weight must be a finite"),
    ('rewards=[{name = "format"}, {name = "format"}]', "appears twice"),
    ('rewards=[{name = "format", wieght = 1}]', "keys name and weight"),
    ("multi_objective_aggregation=mean", "multi_objective_aggregation must be one of"),
])
def test_bad_reward_config_names_the_field(override, message):
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(overrides=[override])


def test_overlong_needs_a_buffer_inside_the_budget():
    config = RunConfig(rewards=[{"name": "overlong", "weight": 1.0}], overlong_buffer_len=64)
    with pytest.raises(InputError, match="overlong_buffer_len must be in \\[1, max_new_tokens=48\\]"):
        validate(config)


def test_rewards_load_from_toml_with_weights(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('rewards = [{name = "correctness", weight = 1.0}, {name = "format", '
                    'weight = 0.25}]\nmulti_objective_aggregation = "normalize_then_sum"\n')
    config = load_config(config_file=str(path))
    assert config.rewards == [{"name": "correctness", "weight": 1.0},
                              {"name": "format", "weight": 0.25}]
    assert config.multi_objective_aggregation == "normalize_then_sum"



def _records(reward_versions, rewards):
    return [{"prompt_id": "p1", "source_policy_version": "pol", "verifier_version": "v1",
             "trace_id": f"t{i}", "reward_versions": reward_versions, "rewards": rewards}
            for i in range(2)]


def test_the_step_contract_checks_every_components_version():
    from grpogate.evidence.decisions import check_step_contract

    expected = {"correctness": "v1", "format": "format-v1"}
    values = {"correctness": 1.0, "format": 0.0}
    assert check_step_contract(_records(expected, values), "pol", "v1", 2, expected) == {
        "admitted": True, "failed_checks": []}
    # One component at another version, or a component missing from a record: not admitted.
    other = {"correctness": "v1", "format": "format-v2"}
    assert check_step_contract(_records(other, values), "pol", "v1", 2, expected) == {
        "admitted": False, "failed_checks": ["reward_versions"]}
    assert check_step_contract(_records(expected, {"correctness": 1.0}), "pol", "v1", 2,
                               expected)["failed_checks"] == ["reward_versions"]
    # Without expected versions the docs/design.md §5 contract is unchanged.
    assert check_step_contract(_records(other, values), "pol", "v1", 2)["admitted"] is True


SWALLOWING = '''
import time

def stubborn(completion, reference):
    try:
        time.sleep(5)
    except Exception:  # a user's broad handler must not swallow the time limit
        time.sleep(5)
    return 1.0
'''


def test_a_users_broad_except_cannot_swallow_the_time_limit(tmp_path, monkeypatch):
    (tmp_path / "stubborn_12.py").write_text(SWALLOWING)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        rewards = reward_set(("stubborn_12:stubborn", 1.0), user_time_limit_seconds=0.2)
        started = time.perf_counter()
        assert rewards.score("x", "#### 1", 1, correctness=0.0) == {"stubborn_12:stubborn": 0.0}
        assert time.perf_counter() - started < 2.0 and rewards.error_count == 1
    finally:
        sys.modules.pop("stubborn_12", None)
