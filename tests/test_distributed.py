"""Under torchrun (gloo on the CPU, the tiny random Llama): the same run as one process.

Every launch goes through `torchrun_job`, which starts torchrun in its own process group with a
deadline and kills the whole group on the way out, whatever happened, so a hang or a failed
assertion never leaks workers into CI. `--standalone` lets torchrun pick a free port.
- The 2-process run reproduces the 1-process run: trajectories (sampler log-probs included: a
  rank samples with at least 8 rows, as one process does) and re-test completions byte for
  byte, the adapter within 1e-6 (in this layout it is bit-identical), the same decision; one of
  its steps has a single valid group, so one rank has no update work there and still finishes.
- The update with the micro-batches dealt over 2 ranks equals the 1-process update for every
  objective, within 1e-6 of the parameters (float summation order differs).
- SIGKILL of one worker under --max-restarts 1: exit 0 and the uninterrupted adapter.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import sha256

from grpogate import pipeline
from grpogate.cli import torchrun_arguments
from grpogate.files import read_jsonl
from grpogate.training import loop as training

WORKERS = Path(__file__).with_name("torchrun_workers.py")
SRC = Path(__file__).resolve().parents[1] / "src"
SETTINGS = {"train_prompts": 8, "prompts_per_step": 2, "eval_prompts": 4, "group_size": 4,
            "eval_group_size": 2, "max_new_tokens": 8, "lora_r": 4,
            "generation_batch_size": 16, "micro_batch_size": 4, "device": "cpu",
            "dtype": "float32", "seed": 7,
            "gates.minimum_effective_trajectories_per_second": 0.0}
DEADLINE = 240  # seconds for one torchrun job; measured about 35 s on a shared 2-core machine


@contextlib.contextmanager
def torchrun_job(args: list[str], log: Path, env: dict | None = None):
    """A running `torchrun --standalone ...` (its own session); killed with its whole process
    group on exit, so no worker outlives the test."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", *args]
    environment = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{Path(__file__).parent}",
                   "COLUMNS": "200", "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log, "wb") as stream:
        process = subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT,
                                   env=environment, start_new_session=True)
        try:
            yield process
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def finish(process: subprocess.Popen, log: Path, timeout: float = DEADLINE) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun job still running after {timeout} s (a hang?); log:\n"
                    + log.read_text(errors="replace")[-4000:])


def cli_args(model_dir: Path, out: Path) -> list[str]:
    args = ["run", "--profile", "smoke", "--model", str(model_dir), "--out", str(out)]
    for key, value in SETTINGS.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    return args


def pattern(completions, problems, verifier):
    """torchrun_workers.run_cli's training reward, for the in-process 1-process run."""
    return [1.0 if c.sample_index % 2 == 0 and (
        c.prompt_index == 0 or problems[c.prompt_index].prompt_id[0] in "01234567") else 0.0
        for c in completions]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """The 1-process run (in this process) and the 2-process run (torchrun) of one config; the
    run directories share their name, so trace ids (which hash the run label) can be equal."""
    from grpogate.config import load_config

    root = tmp_path_factory.mktemp("distributed")
    one, two = root / "one" / "run", root / "two" / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training, "score_completions", pattern)
        overrides = [f"{key}={json.dumps(value)}" for key, value in SETTINGS.items()]
        pipeline.run(load_config("smoke", overrides=overrides, model=str(tiny_model_dir),
                                 out=str(one)))
    log = root / "two.log"
    with torchrun_job(["--nproc_per_node", "2", str(WORKERS), "run",
                       *cli_args(tiny_model_dir, two)], log) as process:
        assert finish(process, log) == 0, log.read_text(errors="replace")[-4000:]
    return one, two


def test_two_processes_reproduce_the_one_process_run(runs):
    one, two = runs
    assert (two / "trajectories.jsonl").read_bytes() == (one / "trajectories.jsonl").read_bytes()
    assert ((two / "eval_completions.jsonl").read_bytes()
            == (one / "eval_completions.jsonl").read_bytes())
    assert ((two / "guard_completions.jsonl").read_bytes()
            == (one / "guard_completions.jsonl").read_bytes())
    from safetensors.torch import load_file

    adapters = [load_file(run / "adapter" / "adapter_model.safetensors") for run in (one, two)]
    assert adapters[0].keys() == adapters[1].keys()
    for name, tensor in adapters[0].items():
        assert (adapters[1][name] - tensor).abs().max() <= 1e-6, name
    evidence = [json.loads((run / "evidence.json").read_text()) for run in (one, two)]
    # The same decision on the same checks; only the wall-clock ones (throughput, memory) may
    # read other values.
    for key in ("decision", "failed_checks"):
        assert evidence[1]["decision"][key] == evidence[0]["decision"][key]
    checks = [{c["name"]: c["passed"] for c in e["decision"]["checks"]} for e in evidence]
    assert checks[1] == checks[0]
    assert [x for s in evidence[1]["steps"] for x in s["loss"]] == pytest.approx(
        [x for s in evidence[0]["steps"] for x in s["loss"]], abs=1e-6)
    assert evidence[1]["update"]["trained_tokens"] == evidence[0]["update"]["trained_tokens"]
    assert evidence[0]["distributed"]["world_size"] == 1
    distributed = evidence[1]["distributed"]
    assert (distributed["world_size"], distributed["backend"]) == (2, "gloo")
    assert len(distributed["per_rank_seconds"]) == 2
    slowest = distributed["slowest_rank_seconds"]["update"]
    assert slowest["seconds"] == max(r["update"] for r in distributed["per_rank_seconds"])


def test_a_step_where_one_rank_has_no_update_work_finishes(runs):
    """micro_batch_size 4 = one group per micro-batch: a step with one valid group deals its
    only micro-batch to rank 0, and rank 1 joins every collective with zero gradients."""
    _, two = runs
    steps = json.loads((two / "evidence.json").read_text())["steps"]
    valid = [s["valid_group_count"] for s in steps]
    assert 1 in valid and 2 in valid, valid  # both layouts occurred
    assert all(s["update_count"] == 1 for s in steps)


def test_only_rank_zero_wrote_and_the_audit_rebuilds_the_evidence(runs):
    from grpogate.evidence.assemble import assemble_evidence, recorded_facts

    _, two = runs
    names = sorted(p.name for p in two.iterdir())
    assert "checkpoints" not in names and not [n for n in names if n.startswith(".")]
    evidence = json.loads((two / "evidence.json").read_text())
    rebuilt = assemble_evidence(recorded_facts(evidence), evidence["config"], evidence["steps"],
                                read_jsonl(two / "trajectories.jsonl"),
                                read_jsonl(two / "eval_completions.jsonl"),
                                read_jsonl(two / "guard_completions.jsonl"))
    assert rebuilt["distributed"] == evidence["distributed"]
    assert rebuilt["guard"] == evidence["guard"]
    assert rebuilt["decision"] == evidence["decision"]


def test_every_objective_updates_as_in_one_process(tiny_model_dir, tmp_path):
    out, log = tmp_path / "update.json", tmp_path / "update.log"
    with torchrun_job(["--nproc_per_node", "2", str(WORKERS), "update", str(tiny_model_dir),
                       str(out)], log) as process:
        assert finish(process, log) == 0, log.read_text(errors="replace")[-4000:]
    results = json.loads(out.read_text())
    assert set(results) == {"grpo", "bnpo", "dapo", "dr_grpo", "cispo", "gspo",
                            "dapo_mu2_kl_entropy"}
    for name, result in results.items():
        assert result["ranks_agree"], name
        assert result["max_abs_change"] > 1e-5, name  # the update moved the adapter
        assert result["max_abs_difference"] <= 1e-6, (name, result)
        assert result["tokens"][0] == result["tokens"][1], name
        assert result["sequences"][0] == result["sequences"][1], name
        assert result["update_count"][0] == result["update_count"][1] >= 1, name
        assert result["loss"][0] == pytest.approx(result["loss"][1], abs=1e-6), name


def test_a_killed_worker_is_restarted_and_the_run_resumes_to_the_same_adapter(
        runs, tiny_model_dir, tmp_path):
    _, uninterrupted = runs
    run_dir, pids, log = tmp_path / "run", tmp_path / "pids", tmp_path / "killed.log"
    pids.mkdir()
    with torchrun_job(["--nproc_per_node", "2", "--max-restarts", "1", str(WORKERS), "run",
                       *cli_args(tiny_model_dir, run_dir)], log,
                      env={"PID_DIR": str(pids)}) as process:
        deadline = time.monotonic() + DEADLINE
        while not (run_dir / "checkpoints" / "step-000001").is_dir():  # a step is finished
            assert process.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.02)
        os.kill(int((pids / "rank1-attempt0").read_text()), signal.SIGKILL)
        assert finish(process, log) == 0, log.read_text(errors="replace")[-4000:]
    text = log.read_text(errors="replace")
    assert "restarted by torchrun (restart 1): resuming" in text, text[-4000:]
    assert (pids / "rank1-attempt1").is_file()  # the agent really started a second group
    assert (sha256(run_dir / "adapter" / "adapter_model.safetensors")
            == sha256(uninterrupted / "adapter" / "adapter_model.safetensors"))
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert evidence["distributed"]["restart_count"] == 1 and len(evidence["resumes"]) == 1
    assert ((run_dir / "trajectories.jsonl").read_bytes()
            == (uninterrupted / "trajectories.jsonl").read_bytes())


def test_grpogate_run_nproc_passes_every_other_argument_to_the_workers():
    assert torchrun_arguments(["run", "--nproc", "2", "--set", "seed=3", "--max-restarts=1",
                               "--out", "d"]) == ["run", "--set", "seed=3", "--out", "d"]


def test_a_stop_on_one_rank_stops_every_rank_at_the_same_safe_point(tiny_model_dir, tmp_path):
    """SIGTERM to rank 1 alone: rank 0 learns of it at the next safe point (an all-gather of
    the ranks' stop requests), both stop there, and rank 0 writes the interim evidence."""
    run_dir, pids, log = tmp_path / "run", tmp_path / "pids", tmp_path / "stopped.log"
    pids.mkdir()
    args = cli_args(tiny_model_dir, run_dir) + ["--set", "train_prompts=16"]  # 8 steps
    with torchrun_job(["--nproc_per_node", "2", str(WORKERS), "run", *args], log,
                      env={"PID_DIR": str(pids)}) as process:
        deadline = time.monotonic() + DEADLINE
        while not (run_dir / "checkpoints" / "step-000001").is_dir():
            assert process.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.02)
        os.kill(int((pids / "rank1-attempt0").read_text()), signal.SIGTERM)
        finish(process, log)  # both workers exit 143; torchrun reports the failed group
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert evidence["status"] == "interrupted", log.read_text(errors="replace")[-4000:]
    assert evidence["interruption"]["signal"] == "SIGTERM"
    assert 1 <= evidence["interruption"]["completed_steps"] < 8
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "interrupted"
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == (
        evidence["interruption"]["completed_steps"] * 2 * 4)  # only finished steps' groups


class TwoRanks:
    """A World stand-in whose gather returns rank 0's value and a given rank-1 value."""

    def __init__(self, other):
        self.other = other

    def all_gather_object(self, value):
        return [value, self.other]


def test_ranks_that_end_with_different_adapters_fail_loudly():
    pipeline.same_adapter_everywhere(TwoRanks("v1"), "v1")  # the same: nothing to say
    with pytest.raises(RuntimeError, match="adapters differ.*0: v1, 1: v2"):
        pipeline.same_adapter_everywhere(TwoRanks("v2"), "v1")


def test_shards_deal_prompts_round_robin():
    from grpogate.distributed import World, shard

    # 5 prompts over 2 ranks: rank 0 takes 0, 2, 4 and rank 1 takes 1, 3.
    assert shard(5, World(rank=0, world_size=2)) == [0, 2, 4]
    assert shard(5, World(rank=1, world_size=2)) == [1, 3]


def test_gathered_shards_are_listed_in_prompt_order():
    from grpogate.distributed import in_shard_order

    # Rank 0 sampled prompts 0, 2, 4 and rank 1 prompts 1, 3: gathered rank by rank, listed
    # 0, 1, 2, 3, 4 as one process would have sampled them (payloads travel with positions).
    parts = [[(0, "a"), (2, "c"), (4, "e")], [(1, "b"), (3, "d")]]
    assert in_shard_order(parts) == [(0, "a"), (1, "b"), (2, "c"), (3, "d"), (4, "e")]
    assert in_shard_order([[(0, "a")]]) == [(0, "a")]  # one process: unchanged


def test_merged_update_records_sum_counts_and_keep_maxima():
    from grpogate.training.data_parallel import merge_counts

    class Gather:
        distributed = True

        def all_gather_object(self, value):
            return [value, {"tokens": 5, "max": 0.5, "per_pass": [1, 2], "loss": [9.0]}]

    merged = merge_counts(Gather(), {"tokens": 3, "max": 0.7, "per_pass": [3, 4], "loss": [9.0]},
                          maxima=("max",), same=("loss",))
    # tokens 3 + 5 = 8; max(0.7, 0.5) = 0.7; per pass [3 + 1, 4 + 2] = [4, 6]; loss as rank 0's.
    assert merged == {"tokens": 8, "max": 0.7, "per_pass": [4, 6], "loss": [9.0]}


KILL_RANK_1 = '''
import os, signal, threading, time
from pathlib import Path

def _kill_when_ready(path):
    while not Path(path).exists():
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGKILL)

if (os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        and os.environ.get("KILL_RANK_1_WHEN")):
    threading.Thread(target=_kill_when_ready, args=(os.environ["KILL_RANK_1_WHEN"],),
                     daemon=True).start()
'''


def grpogate_job(args: list[str], environment: dict, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m grpogate ARGS` in its own session, killed with its workers on the way out."""
    process = subprocess.Popen([sys.executable, "-m", "grpogate", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=environment, cwd=cwd,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        pytest.fail(f"grpogate {' '.join(args)} still running after {DEADLINE} s (a hang?)")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def test_grpogate_run_nproc_names_a_killed_rank_in_one_line_and_the_resume_works(
        tiny_model_dir, tmp_path):
    """`grpogate run --nproc 2`, rank 1 SIGKILLed once step 1 is checkpointed (a
    sitecustomize in the workers' path does it): one `error:` line naming rank 1 and the
    log, no traceback on the terminal; then the printed resume command finishes the run."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(KILL_RANK_1)
    run_dir = tmp_path / "run"
    environment = {**os.environ, "COLUMNS": "200", "PYTHONPATH": f"{hooks}{os.pathsep}{SRC}",
                   "KILL_RANK_1_WHEN": str(run_dir / "checkpoints" / "step-000001")}
    killed = grpogate_job([*cli_args(tiny_model_dir, run_dir), "--nproc", "2"], environment,
                          tmp_path)
    terminal = killed.stdout + killed.stderr
    errors = [line for line in killed.stderr.splitlines() if line.startswith("error:")]
    assert killed.returncode == 1 and len(errors) == 1, terminal[-4000:]
    log = run_dir / "torchrun-failure.log"
    assert errors[0] == (
        f"error: rank 1 died (killed by SIGKILL); the worker group stopped. Tracebacks: {log}. "
        f"Continue it with `grpogate run --resume {run_dir} --nproc 2`"), errors[0]
    # The run directory line, step 1's line, the error line: no traceback, no agent report.
    assert "Traceback (most recent call last)" not in terminal, terminal[-4000:]
    assert len([line for line in terminal.splitlines() if line.strip()]) <= 4, terminal[-4000:]
    # The agent's own report, kept in the log: rank 1 (local rank 1 here) ended by signal 9.
    assert "failed (exitcode: -9) local_rank: 1" in log.read_text(), log.read_text()[-4000:]
    environment.pop("KILL_RANK_1_WHEN")
    resumed = grpogate_job(["run", "--resume", str(run_dir), "--nproc", "2"], environment,
                           tmp_path)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    # Finished from the checkpoint: every step's groups once (4 steps x 2 prompts x G = 4).
    # (Its status is the random model's: no reward, no effective update.)
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert (run_dir / "manifest.json").is_file() and len(evidence["resumes"]) == 1
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 4 * 2 * 4


def test_a_prompt_alone_samples_the_log_probs_it_gets_in_a_batch(tiny_model_dir):
    """What makes the 2-process trajectories byte-equal to the 1-process ones: a rank that
    samples one prompt (G = 4 rows) gets the log-probs that prompt gets beside another (8 rows).
    Measured before the filler rows, on a bf16-kernel (AMX) Xeon: up to 9.5e-7 apart, because
    the CPU matmul takes another kernel under 8 rows."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpogate.inputs.tasks import Problem, prompt_id
    from grpogate.engines.rows import shared_prefix_length
    from grpogate.sampling.rollout import SamplingSettings, encode_prompts, generate_completions

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    questions = ["How many legs do 3 cats and 2 birds have?",
                 "What is 12 + 30 if you add five more apples?"]
    problems = [Problem(prompt_id(q), q, "7", f"t:{i}") for i, q in enumerate(questions)]
    prompts = encode_prompts(tokenizer, problems, "Answer.", 192)
    settings = SamplingSettings(max_new_tokens=8, temperature=1.0, top_p=1.0, batch_size=16)
    shared = shared_prefix_length(prompts)
    together = generate_completions(model, tokenizer, prompts, 4, settings, seed=7,
                                    shared_prefix=shared)
    alone = [c for index in range(2) for c in generate_completions(
        model, tokenizer, [prompts[index]], 4, settings, seed=7, prompt_indexes=[index],
        shared_prefix=shared)]
    assert [c.completion_token_ids for c in alone] == [c.completion_token_ids for c in together]
    assert [c.sampler_logprobs for c in alone] == [c.sampler_logprobs for c in together]
