"""One error channel (issue 60): every refusal, click's and typer's usage errors included, is one
`error:` line on stderr and exit 2, naming the key or option; stdout holds output alone (the
dry run's JSON parses); every count is checked against its named maximum before any work; TRL's
GRPOConfig names are aliases with a note, or refused with the key to use; `run --help` shows
every default.
"""

from __future__ import annotations

import json
import time

import pytest
from test_bounded_work import GiB, grpogate_cli, one_error
from typer.main import get_command
from typer.testing import CliRunner

from grpogate.cli import app
from grpogate.config import load_config, schema, trl_names
from grpogate.errors import InputError
from grpogate.evidence import rescore

WIDE = {"COLUMNS": "200"}  # rich wraps help and long lines at the terminal width


def refusal(*args: str) -> str:
    """The CLI in-process on `args`: exit 2, nothing on stdout, one `error:` line on stderr."""
    result = CliRunner().invoke(app, list(args), env=WIDE)
    assert result.exit_code == 2, result.output
    assert result.stdout.strip() == "", result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


@pytest.mark.parametrize("args, wanted", [
    (["run", "--stepz", "3"], ["error: run: No such option: --stepz", "(see grpogate run --help)"]),
    (["run", "--steps", "abc"], ["error: run: Invalid value for '--steps'"]),
    (["run", "--nproc", "0"], ["error: run: Invalid value for '--nproc'"]),
    (["decide"], ["error: decide: Missing argument 'RUN_DIR'.", "(see grpogate decide --help)"]),
    (["config", "show", "--nope"], ["error: config show: No such option: --nope",
                                    "(see grpogate config show --help)"]),
    (["nosuch"], ["error: No such command 'nosuch'.", "(see grpogate --help)"]),
], ids=["unknown-option", "not-an-integer", "below-min", "missing-argument", "subcommand-option",
        "unknown-command"])
def test_a_usage_error_is_one_error_line_on_stderr_not_a_box(args, wanted):
    line = refusal(*args)
    for fragment in wanted:
        assert fragment in line, line
    assert "╭" not in line and "Usage:" not in line


def test_bare_grpogate_still_shows_the_help():
    result = CliRunner().invoke(app, [], env=WIDE)
    assert "error:" not in result.output and "decide" in result.output and "run" in result.output


@pytest.mark.parametrize("args, wanted", [
    (["--set", "learning_rate=abc"],
     "error: --set learning_rate=abc: learning_rate must be a number, got 'abc'"),
    (["--set", "task.train_seed=x"],
     "error: --set task.train_seed=x: task.train_seed must be a whole number (int), got 'x'"),
    (["--set", "guard=3"], "error: --set guard=3: guard must be a table of keys (got 3)"),
], ids=["float", "nested-int", "table"])
def test_a_bad_value_names_its_source_key_and_value(args, wanted):
    assert refusal("config", "show", *args) == wanted


def test_a_bad_value_in_a_config_file_names_the_file_and_the_key(tmp_path):
    config = tmp_path / "cfg.toml"
    config.write_text('learning_rate = "abc"\n[task]\ntrain_seed = "x"\n')
    assert refusal("config", "show", "--config", str(config)) == (
        f"error: {config}: learning_rate must be a number, got 'abc'")


def test_the_dry_runs_json_is_alone_on_stdout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "--dry-run", "--json", "--set", "train_prompts=8",
                                      "--set", "prompts_per_step=8", "--set", "eval_prompts=4",
                                      "--set", "guard.prompts=0"], env=WIDE)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # the whole of stdout parses: `| jq` works
    assert (report["train_prompts"], report["eval_prompts"], report["steps"]) == (8, 4, 1)
    assert result.stderr.splitlines()[-1] == ("dry run passed: configuration, inputs and "
                                              "environment are usable")
    assert list(tmp_path.iterdir()) == []


def test_json_without_the_dry_run_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert refusal("run", "--json").startswith("error: --json goes with --dry-run")
    assert list(tmp_path.iterdir()) == []


# --- every count against its named maximum, before any work -------------------------------------

def test_a_billion_steps_is_refused_in_seconds_without_generating_a_problem():
    """Before: problems generated for 8e9 prompts, killed at 60 s with 1.9 GB resident (4 GiB
    cap). The bound is checked when the configuration loads: under a 2 GiB address-space cap
    the refusal comes long before a 60 s timeout."""
    started = time.monotonic()
    result = grpogate_cli("run", "--steps", "1000000000", "--dry-run", cap=2 * GiB, timeout=60)
    assert one_error(result) == ("error: config: steps must be at most 100,000 (MAX_STEPS; got "
                                 "1,000,000,000)")
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("override, key, cap_name, cap", [
    # 1,000,016 train prompts at 16 a step are 62,501 steps: the prompt cap alone is passed.
    (["prompts_per_step=16", "train_prompts=1000016"], "train_prompts", "MAX_TRAIN_PROMPTS",
     1_000_000),
    (["eval_prompts=100001"], "eval_prompts", "MAX_EVAL_PROMPTS", 100_000),
    (["guard.prompts=100001"], "guard.prompts", "MAX_EVAL_PROMPTS", 100_000),
    (["group_size=1025"], "group_size", "MAX_GROUP_SIZE", 1024),
    (["eval_group_size=1025"], "eval_group_size", "MAX_GROUP_SIZE", 1024),
    (["guard.group_size=1025"], "guard.group_size", "MAX_GROUP_SIZE", 1024),
    (["max_new_tokens=131073"], "max_new_tokens", "MAX_TOKENS", 131_072),
    (["max_prompt_tokens=131073"], "max_prompt_tokens", "MAX_TOKENS", 131_072),
    (["micro_batch_size=65537"], "micro_batch_size", "MAX_BATCH_ROWS", 65_536),
    (["num_iterations=1001"], "num_iterations", "MAX_ITERATIONS", 1000),
    # 8 x 100,001 train prompts at the default 8 a step: the step count names itself.
    (["train_prompts=800008"], "steps", "MAX_STEPS", 100_000),
])
def test_each_count_above_its_maximum_is_refused_naming_key_cap_and_value(override, key,
                                                                           cap_name, cap):
    with pytest.raises(InputError) as refused:
        load_config(overrides=override)
    given = int(override[-1].split("=")[1]) if key != "steps" else 100_001
    assert str(refused.value) == (f"config: {key} must be at most {cap:,} ({cap_name}; got "
                                  f"{given:,})")


def test_each_maximum_is_accepted_and_no_run_cap_exceeds_the_audits():
    # eval_prompts are drawn from task.eval_pool, which must hold them (its cap is theirs).
    at_caps = load_config(overrides=["group_size=1024", "max_new_tokens=131072",
                                     "eval_prompts=100000", "task.eval_pool=100000", "steps=1"])
    assert (at_caps.group_size, at_caps.max_new_tokens, at_caps.eval_prompts) == (
        1024, 131_072, 100_000)
    # A run grpogate starts is one decide can re-check (the audit's caps hold it).
    assert schema.MAX_STEPS <= rescore.MAX_STEPS
    assert max(schema.MAX_TRAIN_PROMPTS, schema.MAX_EVAL_PROMPTS) <= rescore.MAX_PROMPTS
    assert schema.MAX_GROUP_SIZE <= rescore.MAX_GROUP_SIZE
    assert schema.MAX_GENERATION_ROUNDS <= rescore.MAX_GENERATION_ROUNDS


# --- TRL's names ----------------------------------------------------------------------------------

def test_trl_names_are_aliases_of_grpogates_keys(tmp_path):
    config = tmp_path / "trl.toml"
    config.write_text("num_generations = 4\nmax_completion_length = 64\nmax_steps = 3\n"
                      "num_generations_eval = 2\nmax_prompt_length = 100\n")
    loaded = load_config(config_file=str(config))
    # max_steps = 3 steps of the default 8 prompts: 24 train prompts.
    assert (loaded.group_size, loaded.max_new_tokens, loaded.train_prompts,
            loaded.eval_group_size, loaded.max_prompt_tokens) == (4, 64, 24, 2, 100)
    overridden = load_config(overrides=["num_generations=6", "max_steps=2"])
    assert (overridden.group_size, overridden.train_prompts) == (6, 16)


def test_a_trl_alias_is_one_note_on_stderr_naming_the_key():
    trl_names._note.cache_clear()  # said once per process: this test hears it afresh
    result = CliRunner().invoke(app, ["config", "show", "--json", "--set",
                                      "num_generations=12"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["group_size"] == 12
    assert result.stderr == ("note: --set num_generations=12: num_generations is TRL's name; "
                             "grpogate's key is group_size\n")


@pytest.mark.parametrize("override, wanted", [
    ("reward_weights=[1.0, 0.5]", "--set reward_weights=[1.0, 0.5]: unknown key "
     "'reward_weights': TRL's name, with no exact equivalent here; did you mean `rewards` (a "
     "list of tables, e.g. rewards = [{name = \"correctness\", weight = 1.0}, {name = "
     "\"format\", weight = 0.5}])?"),
    ("gradient_accumulation_steps=4", "--set gradient_accumulation_steps=4: unknown key "
     "'gradient_accumulation_steps': TRL's name, with no exact equivalent here; did you mean "
     "`groups_per_update` (valid groups per optimizer step)?"),
    ("group_sise=4", "--set group_sise=4: unknown key 'group_sise'; did you mean `group_size`? "
     "(grpogate config show lists every key)"),
    ("guard.promts=4", "--set guard.promts=4: unknown key 'guard.promts'; did you mean "
     "`guard.prompts`? (grpogate config show lists every key)"),
])
def test_a_trl_name_without_an_equivalent_or_a_typo_is_refused_with_the_key(override, wanted):
    with pytest.raises(InputError) as refused:
        load_config(overrides=[override])
    assert str(refused.value) == wanted


def test_a_trl_alias_beside_its_own_key_is_refused(tmp_path):
    config = tmp_path / "both.toml"
    config.write_text("num_generations = 4\ngroup_size = 8\n")
    with pytest.raises(InputError, match="num_generations and group_size name the same key"):
        load_config(config_file=str(config))


# --- help -------------------------------------------------------------------------------------

def test_run_help_shows_every_default():
    run = get_command(app).commands["run"]
    for option in run.params:
        # typer shows a default other than None, False and empty itself (--max-restarts: 0)
        typer_shows = option.default is not None and option.default is not False and (
            option.default != "" and option.default != [])
        shown = "\\[default: " in (option.help or "") or typer_shows
        assert shown or option.name == "help", option.name
    text = " ".join(CliRunner().invoke(app, ["run", "--help"], env=WIDE).output.split())
    for fragment in ("num_generations). [default: 8]", "[default: 64]", "[default: 0.00015]",
                     "max_completion_length). [default: 48]", "[default: 42]"):
        assert fragment in text, fragment


def test_gate_train_data_help_names_every_format_it_reads():
    gate = get_command(app).commands["gate"]
    help_text = next(p.help for p in gate.params if p.name == "train_data")
    for form in (".jsonl", "parquet", ".csv", ".arrow", "save_to_disk"):
        assert form in help_text, form
    assert "JSONL rows with" not in help_text
