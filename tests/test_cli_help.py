"""The command line explains itself: --version, config show, first-class flags, help text, tables."""

from __future__ import annotations

import json
import re
import tomllib
from importlib.metadata import version

import pytest
from rich.console import Console
from typer.testing import CliRunner

from grpogate.cli import app
from grpogate.config import RunConfig, load_config
from grpogate.config.keys import KEY_HELP, describe_config
from grpogate.cli.terminal import gates_table, human_bytes

runner = CliRunner()


def invoke(*args: str, width: int = 100):
    return runner.invoke(app, list(args), env={"COLUMNS": str(width), "NO_COLOR": "1"})


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"grpogate {version('grpogate')}"


@pytest.mark.parametrize("command", [[], ["run"], ["decide"], ["eval"], ["compare"], ["report"],
                                     ["config", "show"]])
def test_help_has_no_raw_type_tags_or_swallowed_text(command):
    result = invoke(*command, "--help", width=200)
    assert result.exit_code == 0, result.output
    assert not re.search(r"<(str|int|float|bool|list\[str\])>", result.output), result.output
    assert "{run_dir}" not in result.output
    if command == ["run"]:
        assert "one [gates] table" in result.output  # rich markup would have eaten "[gates]"
        for flag in ("--model", "--adapter", "--task", "--steps", "--group-size", "--lr",
                     "--max-new-tokens", "--report-to"):
            assert flag in result.output


def test_every_key_has_a_meaning_from_one_place():
    keys = [key for key, _, _, _ in describe_config(RunConfig())]
    assert "steps" in keys and "gates.minimum_reward_gain" in keys and "task.params" in keys
    assert set(keys) == set(KEY_HELP), set(keys) ^ set(KEY_HELP)
    assert all(KEY_HELP[key] for key in keys)


def test_config_show_prints_every_key_as_a_config_file_that_reproduces_the_profile(tmp_path):
    result = invoke("config", "show", "--profile", "smoke", width=200)
    assert result.exit_code == 0, result.output
    # Each key's line is looked up in its own table: guard.seed is not the run's seed.
    sections, section = {}, ""
    for line in result.output.splitlines():
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        sections.setdefault(section, []).append(line)
    for key, _, type_name, meaning in describe_config(load_config("smoke")):
        table, _, name = key.rpartition(".")
        line = next(line for line in sections[table] if line.lstrip("# ").startswith(name + " = "))
        assert f"# {type_name}: {meaning}" in line
    path = tmp_path / "shown.toml"
    path.write_text(result.output)
    tomllib.loads(result.output)  # valid TOML, comments and all
    assert result.output.startswith("# profile smoke: a pipeline check")  # what it is for
    assert load_config("default", str(path)).to_dict() == load_config("smoke").to_dict()


def test_steps_is_a_key_and_a_flag():
    # smoke: prompts_per_step 4, so 3 steps are 12 training prompts.
    assert load_config("smoke", overrides=["steps=3"]).train_prompts == 12
    assert load_config("smoke", steps=5).steps == 5
    # Order does not matter: steps applies after prompts_per_step, whichever came first.
    assert load_config("smoke", overrides=["steps=3", "prompts_per_step=2"]).train_prompts == 6


def test_a_task_switch_drops_the_previous_tasks_params():
    switched = load_config("default", overrides=["task.name=leg_counting"])
    assert switched.task.params == {}
    flagged = load_config("default", overrides=["task.params.min_animals=2"],
                          task={"source": "reasoning-gym", "name": "leg_counting"})
    assert flagged.task.params == {"min_animals": 2}  # params given with the switch stay
    kept = load_config("default", overrides=["task.params.max_digits=3"])
    assert kept.task.params["max_digits"] == 3 and kept.task.params["min_terms"] == 2


def test_dry_run_reports_the_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("run", "--dry-run", "--json", "--steps", "4", "--group-size", "4", "--lr",
                    "1e-4", "--max-new-tokens", "16", "--task", "reasoning-gym:leg_counting")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["steps"] == 4 and report["train_prompts"] == 32  # 4 steps x 8 prompts
    assert report["verifier"].startswith("reasoning-gym/leg_counting")


def test_human_bytes_by_hand():
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.5 KiB"  # 1536 / 1024
    assert human_bytes(3.4 * 2**30) == "3.4 GiB"
    assert human_bytes(10 * 1024**3) == "10.0 GiB"


def test_gates_table_fits_80_columns_one_line_per_check(tmp_path):
    from synthetic_run import write_synthetic_run

    run_dir = write_synthetic_run(tmp_path)
    checks = json.loads((run_dir / "evidence.json").read_text())["decision"]["checks"]
    assert {"memory", "effective_throughput", "contract"} <= {c["name"] for c in checks}
    console = Console(width=80, record=True, color_system=None)
    console.print(gates_table({"checks": checks}))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    for check in checks:  # each check on one line, name and value whole
        # The table shows floats to 4 significant digits (the lower bound 0.0 reads "0").
        shown = f"{check['value']:.4g}" if isinstance(check["value"], float) else str(check["value"])
        value = "953.7" if check["name"] == "memory" else shown[:3]
        assert any(f"│ {check['name']} " in line and value in line for line in lines), check
    # The synthetic run's peak is 10**9 bytes (0.93 GiB); the default gate is 10 GiB.
    assert any("953.7 MiB" in line and "10.0 GiB" in line for line in lines), lines


def test_library_noise_is_quiet_and_grpogates_own_lines_are_shown(tiny_model_dir, capfd):
    import logging
    import warnings

    from transformers import AutoModelForCausalLM

    from grpogate.cli.terminal import quiet_libraries

    quiet_libraries()
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.",
                      FutureWarning)
        warnings.warn("another FutureWarning stays visible", FutureWarning)
    assert [str(w.message) for w in caught] == ["another FutureWarning stays visible"]
    capfd.readouterr()
    AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert "Loading weights" not in capfd.readouterr().err
    logging.getLogger("grpogate").info("dequantizing x.gguf (first use only, about 20 s)")
    assert "dequantizing x.gguf" in capfd.readouterr().err  # a message: stderr


def test_the_first_use_of_a_gguf_says_it_is_dequantizing(tmp_path, caplog, monkeypatch):
    """The 20 s dequantization announces itself before it starts (stopped right after here)."""
    import logging

    import transformers

    from grpogate.inputs import model_cache

    def stop(*args, **kwargs):
        raise RuntimeError("stopped after the notice")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", stop)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with caplog.at_level(logging.INFO, logger="grpogate"), pytest.raises(RuntimeError):
        model_cache.dequantized_cache(gguf, "ab" * 32, tmp_path / "cache")
    assert any("dequantizing model.gguf" in r.getMessage() and "first use only" in r.getMessage()
               for r in caplog.records)
