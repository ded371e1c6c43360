"""The bad-input catalogue: one row a case, each run through the real CLI (`grpogate run`).

Every case must end with exit code 2, one line `error: ...` naming the file, line and field
where there is one, and nothing written: the output directory does not exist afterwards and
the working directory stays empty. A row is (id, how to build the bad input, the expected
message fragment); the builder gets a `Case` to write files into and returns the CLI args.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from grpogate.cli import app

TINY = {"train_prompts": 2, "prompts_per_step": 2, "eval_prompts": 2, "group_size": 4,
        "eval_group_size": 2, "max_new_tokens": 8, "lora_r": 4, "device": "cpu"}


def gsm8k_row(number: int) -> str:
    return json.dumps({"question": f"Tom has {number} apples and buys one more. How many now?",
                       "answer": f"{number} + 1 = {number + 1}\n#### {number + 1}"})


class Case:
    """A scratch directory with a valid GSM8K pair (train 1..4, test 11..14) and the tiny model."""

    def __init__(self, root: Path, model: Path):
        self.root, self.model, self.out = root, model, root / "out"
        self.data = root / "data"
        self.data.mkdir()
        self.write_lines("train.jsonl", [gsm8k_row(n) for n in range(1, 5)])
        self.write_lines("test.jsonl", [gsm8k_row(n) for n in range(11, 15)])

    def write_lines(self, name: str, lines: list[str]) -> Path:
        path = self.data / name
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return path

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    def args(self, *extra: str, gsm8k: bool = True, model: str | None = None) -> list[str]:
        args = ["run", "--profile", "smoke", "--model", model or str(self.model),
                "--out", str(self.out)]
        for key, value in TINY.items():
            args += ["--set", f"{key}={json.dumps(value)}"]
        if gsm8k:
            args += ["--set", "task.source=gsm8k", "--set", f"task.path={json.dumps(str(self.data))}"]
        return args + list(extra)

    def baseline_manifest(self, **changes) -> Path:
        """An accepted manifest over a stand-in adapter, with `changes` applied."""
        adapter = self.file("baseline/adapter/adapter_model.safetensors", b"stand-in weights")
        self.file("baseline/adapter/adapter_config.json", "{}")
        manifest = {"decision": "accept", "model": {"location": str(self.model)},
                    "adapter": {"path": "adapter",
                                "sha256": hashlib.sha256(adapter.read_bytes()).hexdigest()}}
        for key, value in changes.items():
            if key.startswith("adapter_"):
                manifest["adapter"][key.removeprefix("adapter_")] = value
            else:
                manifest[key] = value
        return self.file("baseline/manifest.json", json.dumps(manifest))


def replace_line(case: Case, name: str, number: int, line: str | bytes) -> None:
    path = case.data / name
    lines = path.read_bytes().split(b"\n")
    lines[number - 1] = line if isinstance(line, bytes) else line.encode()
    path.write_bytes(b"\n".join(lines))


def malformed_line(case):
    replace_line(case, "train.jsonl", 3, '{"question": "How many?", "answer": ')
    return case.args()


def missing_field(field):
    def build(case):
        row = json.loads(gsm8k_row(2))
        del row[field]
        replace_line(case, "train.jsonl", 2, json.dumps(row))
        return case.args()
    return build


def answer(text):
    def build(case):
        replace_line(case, "train.jsonl", 4, json.dumps({"question": "What is 2 + 2?",
                                                         "answer": text}))
        return case.args()
    return build


def non_string_question(case):
    replace_line(case, "test.jsonl", 1, json.dumps({"question": 17, "answer": "#### 17"}))
    return case.args()


def empty_file(name):
    def build(case):
        case.write_lines(name, [])
        return case.args()
    return build


def overlap(case):
    case.write_lines("train.jsonl", [gsm8k_row(1), gsm8k_row(2)])
    case.write_lines("test.jsonl", [gsm8k_row(11), gsm8k_row(2)])
    return case.args()


def overlap_hidden_by_a_zero_width_space(case):
    row = json.loads(gsm8k_row(2))
    row["question"] = row["question"].replace("apples", "app\u200bles")
    case.write_lines("train.jsonl", [gsm8k_row(1), gsm8k_row(2)])
    case.write_lines("test.jsonl", [gsm8k_row(11), json.dumps(row)])
    return case.args()


def duplicate_prompt(case):
    # The same question up to case and spacing is the same prompt id.
    row = json.loads(gsm8k_row(1))
    row["question"] = "  " + row["question"].upper()
    case.write_lines("train.jsonl", [gsm8k_row(1), json.dumps(row)])
    return case.args()


def non_utf8(case):
    replace_line(case, "train.jsonl", 2, b'{"question": "caf\xe9 prices?", "answer": "#### 3"}')
    return case.args()


def fake_gguf(case):
    return case.args(model=str(case.file("models/fake.gguf", b"PK\x03\x04 a zip, not a GGUF")))


def pickled_adapter(case):
    case.file("pickled/adapter_config.json", "{}")
    case.file("pickled/adapter_model.bin", b"\x80\x04pickle")
    return case.args("--adapter", str(case.root / "pickled"))


def manifest(**changes):
    def build(case):
        return case.args("--baseline-manifest", str(case.baseline_manifest(**changes)))
    return build


def gates_file(name, text):
    def build(case):
        return case.args("--gates", str(case.file(name, text)))
    return build


def config_file(text):
    def build(case):
        return case.args("--config", str(case.file("cfg.toml", text)))
    return build


def existing_label(case):
    (case.root / "cwd" / "runs" / "taken").mkdir(parents=True)
    (case.root / "cwd" / "runs" / "taken" / "evidence.json").write_text("{}")
    args = case.args("--label", "taken")
    out = args.index("--out")
    return args[:out] + args[out + 2:]


def out_inside_a_run(inner):
    def build(case):
        other = case.root / "cwd" / "other-run"
        for name in ("adapter", "checkpoints/step-000001"):
            (other / name).mkdir(parents=True)
        (other / "trajectories.jsonl").write_text("")
        args = case.args()
        args[args.index("--out") + 1] = str(other / inner)
        return args
    return build


def tiny_adapter(case, name: str = "adapter", targets=("q_proj", "v_proj")) -> Path:
    """A real PEFT adapter of the tiny model (r = 4 on `targets`)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(case.model)
    get_peft_model(model, LoraConfig(r=4, target_modules=list(targets), task_type="CAUSAL_LM")
                   ).save_pretrained(case.root / name)
    return case.root / name


def adapter_case(change):
    def build(case):
        directory = tiny_adapter(case)
        change(directory)
        return case.args("--adapter", str(directory))
    return build


def empty_weights(directory):
    (directory / "adapter_model.safetensors").write_bytes(b"")


def truncated_weights(directory):
    weights = directory / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def weights_of_another_shape(directory):
    from safetensors.torch import load_file, save_file

    weights = directory / "adapter_model.safetensors"
    save_file({name: tensor[..., :32].contiguous() if "lora_A" in name else tensor
               for name, tensor in load_file(weights).items()}, weights)


def config_change(**changes):
    def change(directory):
        config = json.loads((directory / "adapter_config.json").read_text())
        config.update(changes)
        (directory / "adapter_config.json").write_text(json.dumps(config))
    return change


def read_only_out(case):
    probe = Path("/sys/grpogate-probe")
    try:
        probe.mkdir()
    except OSError:
        pass
    else:
        probe.rmdir()
        pytest.skip("/sys is writable here")
    args = case.args()
    args[args.index("--out") + 1] = "/sys/grpogate-run/out"
    return args


def full_disk(case):
    from grpogate.inputs import budget

    case.monkeypatch.setattr(budget.shutil, "disk_usage",
                             lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096))
    return case.args()


CASES = [
    ("malformed JSONL line", malformed_line, "train.jsonl:3: malformed JSON: Expecting value"),
    ("missing question", missing_field("question"), 'train.jsonl:2: field "question": missing'),
    ("missing answer", missing_field("answer"), 'train.jsonl:2: field "answer": missing'),
    ("GSM8K answer without ####", answer("It is 4."),
     'train.jsonl:4: field "answer": no "####" final-answer marker'),
    ("#### without a number", answer("It is 4.\n#### four"),
     'train.jsonl:4: field "answer": "####" is not followed by a number'),
    ("question not a string", non_string_question,
     'test.jsonl:1: field "question": expected a string, got int'),
    ("empty train set", empty_file("train.jsonl"), "train.jsonl: no problems (the file is empty)"),
    ("empty eval set", empty_file("test.jsonl"), "test.jsonl: no problems (the file is empty)"),
    ("no eval prompts asked", lambda case: case.args("--set", "eval_prompts=0"),
     "config: train_prompts and eval_prompts must be >= 1"),
    ("train/eval overlap", overlap, "train and eval sets share 1 prompt(s)"),
    ("train/eval overlap hidden by a zero-width space", overlap_hidden_by_a_zero_width_space,
     "train and eval sets share 1 prompt(s)"),
    ("GSM8K final answer in non-ASCII digits", answer("Three.\n#### \u0663"),
     'train.jsonl:4: field "answer": the number after "####" uses non-ASCII digits'),
    ("duplicate prompts", duplicate_prompt, "gsm8k train set: duplicate prompt id"),
    ("non-UTF-8 bytes", non_utf8, "train.jsonl:2: not valid UTF-8 (byte 17: b'\\xe9')"),
    ("prompt over max_prompt_tokens", lambda case: case.args("--set", "max_prompt_tokens=40"),
     "over max_prompt_tokens=40; raise max_prompt_tokens or drop the problem"),
    ("group size < 2", lambda case: case.args("--set", "group_size=1"),
     "config: group_size must be >= 2 (got 1)"),
    ("unknown task", lambda case: case.args("--set", "task.name=no_such_task", gsm8k=False),
     "task.name: unknown reasoning-gym dataset 'no_such_task'; reasoning-gym knows"),
    ("unknown task source", lambda case: case.args("--set", "task.source=kaggle", gsm8k=False),
     "config: task.source must be one of reasoning-gym, gsm8k, dataset (got 'kaggle')"),
    ("unknown verifier", lambda case: case.args("--set", "verifier=no-such-verifier"),
     "verifier: unknown verifier 'no-such-verifier'; known verifiers:"),
    ("missing model path", lambda case: case.args(model="/nonexistent/model-dir"),
     "/nonexistent/model-dir: no such model path"),
    ("a GGUF that is not a GGUF", fake_gguf, "fake.gguf: not a GGUF file (missing the GGUF magic"),
    ("adapter without safetensors", pickled_adapter,
     "no adapter_model.safetensors; adapters load only from safetensors"),
    ("adapter hash differs from the baseline manifest", manifest(adapter_sha256="0" * 64),
     "manifest.json: field \"adapter.sha256\" is '" + "0" * 64 + "' but the adapter file hashes to"),
    ("baseline manifest adapter escapes its directory", manifest(adapter_path="../../etc"),
     "manifest.json: field \"adapter.path\" escapes the manifest's directory"),
    ("baseline manifest decision not accept", manifest(decision="tune"),
     "manifest.json: field \"decision\" is 'tune'; only an accepted policy can be a baseline"),
    ("output label that already exists", existing_label,
     "runs/taken: output already exists; choose a new run label"),
    ("--out inside another run's adapter/", out_inside_a_run("adapter/new"),
     "adapter/new: inside the run directory"),
    ("--out inside another run's checkpoints/", out_inside_a_run("checkpoints/x"),
     "checkpoints/x: inside the run directory"),
    ("temperature inf", lambda case: case.args("--set", "temperature=inf"),
     "config: temperature must be a finite number (got inf)"),
    ("lora_dropout nan", lambda case: case.args("--set", "lora_dropout=nan"),
     "config: lora_dropout must be a finite number (got nan)"),
    ("seed out of range", lambda case: case.args("--seed", str(10**20)),
     "config: seed must be in [0, 4294967295] (got 100000000000000000000)"),
    # Within the named maximums (config/schema.py), beyond what the machine or the model holds.
    ("group size that cannot fit in memory",
     lambda case: case.args("--set", "group_size=1024", "--set", "micro_batch_size=65536"),
     "config: estimated peak memory"),
    ("max_new_tokens over the model's context",
     lambda case: case.args("--set", "max_new_tokens=100000"),
     "config: max_prompt_tokens + max_new_tokens = 100192 exceeds the model's context of "
     "512 tokens"),
    ("zero-byte adapter safetensors", adapter_case(empty_weights),
     "adapter_model.safetensors: not a safetensors file (0 bytes; truncated or empty)"),
    ("truncated adapter safetensors", adapter_case(truncated_weights), "(truncated?)"),
    ("adapter for another base shape", adapter_case(weights_of_another_shape),
     "does not load onto this base model (Error(s) in loading state_dict"),
    ("adapter target modules that match nothing",
     adapter_case(config_change(target_modules=["no_such_proj"])),
     "does not load onto this base model (Target modules"),
    ("adapter_config.json lists fewer modules than the file holds",
     adapter_case(config_change(target_modules=["q_proj"])),
     "adapter_config.json loads 4 of the 8 tensors in adapter_model.safetensors"),
    ("LoRA target modules that match nothing",
     lambda case: case.args("--set", "lora_target_modules=no_such_proj"),
     "config: lora_target_modules='no_such_proj' (Target modules"),
    ("read-only output", read_only_out, "cannot write in /sys (Permission denied)"),
    ("full output filesystem", full_disk, "No space left on device in"),
    ("gates file with an unknown gate",
     gates_file("gates.toml", "[gates]\nminimum_valid_group_ratio = 0.2\nno_such_gate = 1\n"),
     "gates.toml: unknown gate 'no_such_gate' in [gates]; known gates: minimum_valid_group_ratio"),
    ("gates file with a NaN gate",
     gates_file("gates.toml", "[gates]\nminimum_update_count = nan\n"),
     "gates.toml: gates.minimum_update_count must be a finite number, got nan"),
    ("gates file with a negative gate",
     gates_file("gates.toml", "[gates]\nmaximum_max_length_hit_ratio = -0.5\n"),
     "gates.toml: gate 'maximum_max_length_hit_ratio' must be >= 0, got -0.5"),
    ("gates file with a NaN ratio gate",
     gates_file("gates.toml", "[gates]\nminimum_valid_group_ratio = nan\n"),
     "gates.toml: gate 'minimum_valid_group_ratio' must be a finite number, got nan"),
    ("JSON gates file with a NaN gate",
     gates_file("gates.json", '{"gates": {"maximum_peak_allocated_bytes": NaN}}'),
     "gates.json: gates.maximum_peak_allocated_bytes must be a finite number, got nan"),
    ("gates file without a [gates] table", gates_file("gates.toml", "minimum_update_count = 1\n"),
     "gates.toml: a gates file holds exactly one table, [gates]"),
    ("config file with an unknown gate", config_file("[gates]\nno_such_gate = 1\n"),
     "cfg.toml: unknown key 'gates.no_such_gate'"),
    ("config file with a negative gate", config_file("[gates]\nminimum_update_count = -1\n"),
     "cfg.toml: gate 'minimum_update_count' must be >= 0, got -1"),
    ("--set with a NaN gate", lambda case: case.args("--set", "gates.minimum_reward_gain=nan"),
     "--set gates.minimum_reward_gain=nan: gate 'minimum_reward_gain' must be a finite number"),
]


@pytest.mark.parametrize("build, fragment", [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_bad_input_is_one_clear_line_exit_2_and_nothing_written(build, fragment, tiny_model_dir,
                                                               tmp_path, monkeypatch):
    case = Case(tmp_path, tiny_model_dir)
    case.monkeypatch = monkeypatch
    args = build(case)
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    before = sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*"))
    monkeypatch.chdir(cwd)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    # The error channel is stderr; stdout holds nothing.
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert result.stdout.strip() == "", result.output
    assert fragment in lines[0], lines[0]
    assert not case.out.exists()
    assert sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*")) == before


def test_the_catalogue_covers_every_case_the_issue_names():
    named = {case[0] for case in CASES}
    assert named >= {
        "malformed JSONL line", "missing question", "missing answer", "GSM8K answer without ####",
        "empty train set", "empty eval set", "train/eval overlap", "duplicate prompts",
        "group size < 2", "unknown task", "unknown verifier", "missing model path",
        "a GGUF that is not a GGUF", "adapter hash differs from the baseline manifest",
        "baseline manifest decision not accept", "output label that already exists",
        "gates file with an unknown gate", "gates file with a NaN gate",
        "gates file with a negative gate", "non-UTF-8 bytes"}


# What a dry run catches without loading weights: the same line, exit 2, nothing written.
DRY_RUN_CASES = {"prompt over max_prompt_tokens", "temperature inf", "lora_dropout nan",
                 "seed out of range", "group size that cannot fit in memory",
                 "max_new_tokens over the model's context", "zero-byte adapter safetensors",
                 "truncated adapter safetensors", "LoRA target modules that match nothing",
                 "read-only output", "full output filesystem", "--out inside another run's adapter/"}


@pytest.mark.parametrize("build, fragment", [case[1:] for case in CASES if case[0] in DRY_RUN_CASES],
                         ids=[case[0] for case in CASES if case[0] in DRY_RUN_CASES])
def test_a_dry_run_refuses_what_the_run_would_refuse(build, fragment, tiny_model_dir, tmp_path,
                                                     monkeypatch):
    test_bad_input_is_one_clear_line_exit_2_and_nothing_written(
        lambda case: build(case) + ["--dry-run"], fragment, tiny_model_dir, tmp_path, monkeypatch)


def test_every_dry_run_case_is_in_the_catalogue():
    assert DRY_RUN_CASES <= {case[0] for case in CASES}
