"""The command line: exit codes and one-line errors for bad input; nothing written on failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from grpogate.cli import app

GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
needs_gsm8k = pytest.mark.skipif(not GSM8K_DIR.is_dir(), reason=f"GSM8K not found at {GSM8K_DIR}")


@pytest.fixture
def invoke(tmp_path, monkeypatch):
    """Run the CLI in an empty working directory; returns (result, files created there)."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()

    def call(*args: str):
        result = runner.invoke(app, list(args))
        return result, sorted(p.name for p in tmp_path.iterdir())

    return call


def one_line_error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith("error:"), output
    return lines[0]


@needs_gsm8k
def test_dry_run_of_the_reference_profile_passes(invoke, tiny_model_dir, tmp_path_factory,
                                                 monkeypatch):
    """Its hub id resolves offline from a cache holding it (the tiny model under that id)."""
    from huggingface_hub import constants

    from helpers import hub_cache

    cache = tmp_path_factory.mktemp("hub")
    hub_cache(tiny_model_dir, cache, "Qwen/Qwen2.5-0.5B-Instruct",
              config_changes={"max_position_embeddings": 32768})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    result, created = invoke("run", "--dry-run", "--json", "--profile", "gsm8k_qwen05b",
                             "--device", "cpu", "--set", f"task.path={json.dumps(str(GSM8K_DIR))}")
    assert result.exit_code == 0, result.output
    assert "dry run passed" in result.stderr
    assert json.loads(result.stdout)["verifier"] == "gsm8k-final-number-v1"
    assert created == []


@pytest.mark.parametrize("args, fragments", [
    (["--set", "group_size=1"], ["group_size", ">= 2"]),
    # an unknown profile is named, and so is every known one
    (["--profile", "nope"], ["'nope'", "default", "smoke", "gsm8k_qwen05b"]),
    (["--set", "foo=1"], ["unknown key 'foo'"]),
    *[(["--set", f"gates.minimum_valid_group_ratio={value}"], ["minimum_valid_group_ratio"])
      for value in ("-1", "nan", "inf")],
], ids=["group-size-1", "unknown-profile", "unknown-key", "gate--1", "gate-nan", "gate-inf"])
def test_bad_command_line_input_is_one_error_line_and_writes_nothing(invoke, args, fragments):
    result, created = invoke("run", *args)
    assert result.exit_code == 2, result.output
    line = one_line_error(result.output)
    for fragment in fragments:
        assert fragment in line
    assert created == []


def test_a_negative_gain_gate_is_allowed_in_a_dry_run(invoke):
    # The two gain gates are signed: "accept a small regression" is a legitimate policy.
    result, created = invoke("run", "--dry-run", "--set", "gates.minimum_reward_gain=-0.05",
                             "--set", "train_prompts=8", "--set", "prompts_per_step=8",
                             "--set", "eval_prompts=4")
    assert result.exit_code == 0, result.output
    assert created == []


def test_a_gates_file_sets_gates_below_set_overrides(tmp_path):
    from grpogate.config import load_config

    toml = tmp_path / "gates.toml"
    toml.write_text("[gates]\nminimum_valid_group_ratio = 0.3\nminimum_update_count = 2\n"
                    "require_significant_gain = false\n")
    config = load_config("smoke", gates_file=str(toml),
                         overrides=["gates.minimum_update_count=5"])
    assert config.gates.minimum_valid_group_ratio == 0.3
    assert config.gates.minimum_update_count == 5  # --set wins over the gates file
    assert config.gates.require_significant_gain is False  # the file turns the default's off
    as_json = tmp_path / "gates.json"
    as_json.write_text('{"gates": {"maximum_max_length_hit_ratio": 0.25}}')
    assert load_config(gates_file=str(as_json)).gates.maximum_max_length_hit_ratio == 0.25


def test_a_dry_run_reads_the_gates_file(invoke, tmp_path):
    gates = tmp_path / "gates.toml"
    gates.write_text("[gates]\nminimum_valid_group_ratio = 0.3\n")
    result, created = invoke("run", "--dry-run", "--gates", str(gates),
                             "--set", "train_prompts=8", "--set", "prompts_per_step=8",
                             "--set", "eval_prompts=4")
    assert result.exit_code == 0, result.output
    assert created == ["gates.toml"]


def test_a_smoke_run_says_it_is_a_pipeline_check_and_which_gain_rule_decided(tiny_model_dir,
                                                                             tmp_path):
    """The smoke profile's purpose is printed with its decision, where a user reads it, and so
    is the rule its gain gates read (the default's: the anytime-valid sequential test)."""
    from conftest import TINY_SIZES

    args = ["run", "--profile", "smoke", "--model", str(tiny_model_dir),
            "--out", str(tmp_path / "run")]
    for key, value in TINY_SIZES.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # rich wraps long lines at the terminal width
    assert "profile smoke: a pipeline check" in text
    assert ("gain gates (reward, pass_at_group) pass when an anytime-valid one-sided test shows "
            "'gain > minimum' at level 0.025 (the lower confidence bound above the minimum); the "
            "guard passes when it shows the guard loss below gates.maximum_guard_reward_loss "
            "(gates.require_significant_gain = true)") in text


def test_profile_notes():
    from grpogate.config import load_config, profile_note

    assert "pipeline check" in profile_note("smoke")
    assert profile_note("default") == "" and profile_note("gsm8k_qwen05b") == ""
    assert profile_note("no-such-profile") == ""  # a run dir from a profile since removed
    # The note is what the profile is for, not a setting: loading the profile ignores it.
    assert not hasattr(load_config("smoke"), "note")
