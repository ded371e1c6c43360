"""The Python API (`grpogate.load_config`, `grpogate.run`): a run made from Python is the run
the CLI makes from the same configuration (same adapter, byte for byte), errors are
`InputError`, and a TRL-signature reward function trains unchanged inside it."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_SIZES
from helpers import sha256
from typer.testing import CliRunner

import grpogate
from grpogate.cli import app

REWARDS = [{"name": "correctness", "weight": 1.0},
           {"name": "trl_style_rewards:parity_reward", "weight": 0.5}]


def toml_rewards() -> str:
    return "rewards=[" + ", ".join(
        f'{{name = "{r["name"]}", weight = {r["weight"]}}}' for r in REWARDS) + "]"


def test_a_python_run_equals_the_cli_run_with_a_trl_reward_function(tiny_model_dir, tmp_path):
    keys = {**TINY_SIZES, "rewards": REWARDS}
    result = grpogate.run(grpogate.load_config("smoke", model=str(tiny_model_dir),
                                               out=str(tmp_path / "api"), **keys))
    assert result.decision in ("accept", "tune", "reject")
    assert result.run_dir == tmp_path / "api"
    assert result.reward_mean_gain == result.evidence["comparison"]["reward_mean_gain"]
    low, high = result.reward_mean_gain_interval
    assert low <= result.reward_mean_gain <= high
    sets = [f"{key}={json.dumps(value)}" for key, value in TINY_SIZES.items()] + [toml_rewards()]
    cli = CliRunner().invoke(app, ["run", "--profile", "smoke", "--model", str(tiny_model_dir),
                                   "--out", str(tmp_path / "cli"),
                                   *sum((["--set", s] for s in sets), [])])
    assert cli.exit_code == 0, cli.output
    assert sha256(tmp_path / "cli" / "adapter" / "adapter_model.safetensors") == sha256(
        result.run_dir / "adapter" / "adapter_model.safetensors")
    # The TRL-signature function scored every training completion, versioned by its source.
    records = [json.loads(line) for line in (tmp_path / "cli" / "trajectories.jsonl").open()]
    name = "trl_style_rewards:parity_reward"
    assert records and all(r["rewards"][name] == float(len(r["completion"]) % 2) for r in records)
    assert all(r["reward_versions"][name].endswith("+trl-signature") for r in records)
    # reward = 1.0 x correctness + 0.5 x parity, for every record
    assert all(r["reward"] == r["rewards"]["correctness"] + 0.5 * r["rewards"][name]
               for r in records)
    decided = CliRunner().invoke(app, ["decide", str(tmp_path / "cli")])
    assert decided.exit_code == 0 and "agrees" in decided.output, decided.output


def test_api_errors_are_input_errors(tiny_model_dir, tmp_path):
    with pytest.raises(grpogate.InputError, match="unknown key 'group_sise'"):
        grpogate.load_config("smoke", group_sise=4)
    config = grpogate.load_config("smoke", model=str(tiny_model_dir), out=str(tmp_path))
    with pytest.raises(grpogate.InputError, match="already exists"):
        grpogate.run(config)  # tmp_path exists: a run never overwrites
    config.group_size = 0
    with pytest.raises(grpogate.InputError, match="group_size"):
        grpogate.run(config)
