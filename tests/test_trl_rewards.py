"""TRL-signature reward functions as grpogate components (no torch): detected from the
signature, called with TRL's arguments, versioned, time-limited; None is "not applicable"."""

from __future__ import annotations


from grpogate.evidence.metrics import component_means
from grpogate.inputs.rewards import build_reward_set, trl_signature


def reward_set(*names, weights=None, limit=1.0):
    specs = [{"name": "correctness", "weight": 1.0}] + [
        {"name": name, "weight": (weights or {}).get(name, 0.5)} for name in names]
    return build_reward_set(specs, "verifier-v1", max_new_tokens=48, overlong_buffer_len=16,
                            overlong_penalty_factor=1.0, user_time_limit_seconds=limit)


def test_the_signature_decides_the_calling_convention():
    import trl_style_rewards

    assert trl_signature(trl_style_rewards.parity_reward)
    assert not trl_signature(lambda completion, reference: 0.0)


def test_trl_functions_score_one_completion_with_trls_arguments():
    rewards = reward_set("trl_style_rewards:parity_reward", "trl_style_rewards:echoes_the_question")
    values = rewards.score("abc", "3", 2, 1.0, question="1+2?")
    assert values == {"correctness": 1.0, "trl_style_rewards:parity_reward": 1.0,
                      "trl_style_rewards:echoes_the_question": 0.0}
    assert rewards.score("so 1+2? is 3", "3", 5, 1.0, question="1+2?")[
        "trl_style_rewards:echoes_the_question"] == 1.0
    # 1.0 x 1 + 0.5 x 1 + 0.5 x 0 = 1.5
    assert rewards.total(values) == 1.5
    version = rewards.versions["trl_style_rewards:parity_reward"]
    assert version.startswith("trl_style_rewards:parity_reward@sha256:")
    assert version.endswith("+trl-signature")


def test_none_is_not_applicable_and_left_out_of_the_total():
    name = "trl_style_rewards:short_answer_reward"
    rewards = reward_set(name, weights={name: 2.0})
    applies, does_not = rewards.score("short", "7", 1, 0.0), rewards.score("short", "", 1, 1.0)
    assert applies[name] == 1.0 and does_not[name] is None and rewards.error_count == 0
    # TRL's nansum: 1.0 x 0 + 2.0 x 1 = 2.0; and 1.0 x 1 + (None skipped) = 1.0
    assert rewards.total(applies) == 2.0 and rewards.total(does_not) == 1.0
    means = component_means([{"rewards": applies}, {"rewards": does_not}])
    assert means == {"correctness": 0.5, name: 1.0}  # the mean over the records it applies to


def test_a_trl_function_runs_under_the_time_limit():
    rewards = reward_set("trl_style_rewards:slow_reward", limit=0.2)
    assert rewards.score("x", "1", 1, 1.0)["trl_style_rewards:slow_reward"] == 0.0
    assert rewards.error_counts == {"trl_style_rewards:slow_reward": 1}
