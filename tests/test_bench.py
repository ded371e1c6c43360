"""The grpogate-vs-TRL benchmark (bench/): its table arithmetic, TRL's settings, the ideal timer.

The numbers in the table tests are hand-made results with round values, so every ratio below is
worked out by hand; the end-to-end run uses the tiny random Llama and is marked slow.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import bench_table  # noqa: E402
import trl_side  # noqa: E402

GIB = 1024**3
HAS_TRL = importlib.util.find_spec("trl") is not None


def _result(step_seconds, generation_tps, etps, rss_gib, valid_groups, group_size=8):
    return {"steps": [{"seconds": s} for s in step_seconds],
            "generation_tokens_per_second": generation_tps,
            "effective_trajectories_per_second": etps,
            "effective_trajectory_count": valid_groups * group_size,
            "peak_rss_bytes": int(rss_gib * GIB)}


def _eval_records(policy, rewards_by_prompt):
    return [{"policy": policy, "prompt_id": prompt, "completion_tokens": 5, "hit_max_length": False,
             "reward": reward} for prompt, rewards in rewards_by_prompt.items() for reward in rewards]


def _summaries():
    from grpogate.evidence.metrics import summarize_completions

    per_policy = {  # 2 prompts x 2 samples each
        "baseline": {"p1": [0.0, 0.0], "p2": [0.0, 1.0]},   # mean 0.25
        "grpogate": {"p1": [1.0, 0.0], "p2": [1.0, 1.0]},   # mean 0.75
        "trl": {"p1": [0.0, 0.0], "p2": [1.0, 1.0]},        # mean 0.50
        "trl-nogc": {"p1": [0.0, 0.0], "p2": [1.0, 0.0]},   # mean 0.25
    }
    return {name: summarize_completions(_eval_records(name, rewards), 2, 48)
            for name, rewards in per_policy.items()}


def _table():
    results = {
        "grpogate": _result([10.0, 20.0], 300.0, 2.0, 1.0, valid_groups=6),      # 15 s/step
        "trl": _result([100.0, 80.0], 100.0, 0.4, 3.0, valid_groups=8),          # 90 s/step
        "trl-nogc": _result([70.0, 90.0], 150.0, 0.5, 2.0, valid_groups=10),     # 80 s/step
    }
    ideal = {"tokens_per_second": 600.0, "dtype": "bfloat16", "batch_size": 64, "linear_maps": 211,
             "by_dtype": {"float32": {"tokens_per_second": 300.0},
                          "bfloat16": {"tokens_per_second": 600.0}}}
    settings = {"seed": 42, "eval_samples": 2}
    return bench_table.build_table(settings, results, ideal, {"summaries": _summaries()})


def test_ratios_are_taken_against_the_trl_configuration_with_fewer_seconds_per_step():
    table = _table()
    assert table["faster_trl"] == "trl-nogc"  # 80 s/step beats 90 s/step
    assert table["systems"]["grpogate"]["seconds_per_step"] == pytest.approx(15.0)
    assert table["effective_trajectories_per_second_ratio"] == pytest.approx(2.0 / 0.5)
    assert table["effective_trajectories_per_second_ratio_vs_best_trl"] == pytest.approx(4.0)
    assert table["seconds_per_step_ratio"] == pytest.approx(15.0 / 80.0)
    assert table["generation_tokens_per_second_ratio"] == pytest.approx(2.0)
    assert table["peak_rss_ratio"] == pytest.approx(0.5)
    # wall: 48 effective over 30 s vs 80 over 160 s
    assert table["effective_trajectories_per_second_ratio_wall"] == pytest.approx(1.6 / 0.5)


def test_peak_fraction_and_heldout_rewards_are_per_system():
    table = _table()
    assert table["generation_peak_fraction"] == pytest.approx(300.0 / 600.0)
    assert table["systems"]["trl"]["generation_peak_fraction"] == pytest.approx(100.0 / 600.0)
    assert table["heldout_mean_reward"] == pytest.approx(
        {"baseline": 0.25, "grpogate": 0.75, "trl": 0.5, "trl-nogc": 0.25})
    gap = table["heldout_comparison"]["grpogate_minus_trl-nogc"]["reward_mean_gain"]
    assert gap["point"] == pytest.approx(0.5)  # per prompt: p1 +0.5, p2 +0.5


def test_targets_and_printed_table():
    table = _table()
    assert table["targets"] == {
        "effective_trajectories_per_second_ratio >= 4": True,
        "generation_peak_fraction >= 0.5": True,
        "peak_rss_ratio <= 1": True,
        "heldout reward not significantly below TRL": True,
    }
    text = bench_table.format_table(table)
    assert "grpogate / trl-nogc" in text
    assert "4.00x" in text  # effective trajectories/s ratio
    assert "0.50x" in text  # peak RSS ratio
    json.dumps(table)  # the JSON file must serialize


def test_without_trl_the_table_has_grpogate_and_the_ideal_only():
    results = {"grpogate": _result([10.0], 300.0, 2.0, 1.0, valid_groups=6)}
    ideal = {"tokens_per_second": 600.0, "dtype": "float32", "batch_size": 64, "linear_maps": 211,
             "by_dtype": {"float32": {"tokens_per_second": 600.0}}}
    table = bench_table.build_table({"seed": 0, "eval_samples": 2}, results, ideal, None)
    assert table["faster_trl"] is None
    assert "effective_trajectories_per_second_ratio" not in table
    assert table["generation_peak_fraction"] == pytest.approx(0.5)
    assert "grpogate" in bench_table.format_table(table)


def test_the_ideal_is_the_fastest_of_its_timings_and_the_table_shows_each():
    import decode_ideal

    def timing(tokens_per_second):
        return {"tokens_per_second": tokens_per_second, "dtype": "bfloat16", "batch_size": 64,
                "linear_maps": 211, "by_dtype": {"bfloat16": {"tokens_per_second": tokens_per_second}}}

    ideal = decode_ideal.fastest(timing(1473.0), timing(1978.0))
    assert ideal["tokens_per_second"] == 1978.0
    assert ideal["timings_tokens_per_second"] == [1473.0, 1978.0]
    results = {"grpogate": _result([10.0], 989.0, 2.0, 1.0, valid_groups=6)}
    table = bench_table.build_table({"seed": 0, "eval_samples": 2}, results, ideal, None)
    assert table["generation_peak_fraction"] == pytest.approx(0.5)  # 989 / 1978, not / 1473
    assert "the fastest of 2 timings (1473, 1978)" in bench_table.format_table(table)


def test_valid_groups_counts_prompts_whose_rewards_differ():
    pairs = [("a", 0.0), ("a", 1.0), ("b", 0.0), ("b", 0.0), ("c", 1.0), ("c", 1.0)]
    assert trl_side.valid_groups(pairs) == (1, 3)


@pytest.mark.skipif(not HAS_TRL, reason="TRL not installed (pip install -e '.[bench]')")
def test_trl_arguments_make_one_generation_and_one_update_per_step(tmp_path):
    settings = {"group_size": 8, "prompts_per_step": 8, "max_new_tokens": 48,
                "learning_rate": 5e-5, "steps": 3, "seed": 42}
    args = trl_side.trl_arguments(settings, tmp_path, gradient_checkpointing=False)
    assert args.generation_batch_size == 64 and args.steps_per_generation == 1
    assert args.num_iterations == 1 and args.beta == 0.0
    assert args.lr_scheduler_type == "constant" and args.learning_rate == 5e-5
    assert args.gradient_checkpointing is False and args.shuffle_dataset is False
    assert trl_side.trl_arguments(settings, tmp_path, True).gradient_checkpointing is True


def test_decode_ideal_times_every_linear_map():
    import torch
    from decode_ideal import decode_step_tokens_per_second

    measured = decode_step_tokens_per_second([(8, 16), (16, 8), (8, 32)], 4, torch.float32,
                                             round_seconds=0.01, rounds=2)
    assert measured["linear_maps"] == 3
    assert measured["tokens_per_second"] == pytest.approx(4 / measured["seconds_per_decode_step"])


def test_the_ideal_times_every_kernel_the_decoder_can_use_and_keeps_the_fastest(tiny_model_dir):
    import torch
    from decode_ideal import measure_ideal

    from grpogate.engines.cpu.weights import can_prepack

    ideal = measure_ideal(str(tiny_model_dir), 4, torch.get_num_threads(), round_seconds=0.01)
    kernels = {(m["dtype"], m["kernel"]) for m in ideal["by_kernel"]}
    assert ("float32", "F.linear") in kernels
    if can_prepack(torch.zeros(1, dtype=torch.bfloat16)):
        assert {("bfloat16", "F.linear"), ("bfloat16", "oneDNN prepacked")} <= kernels
    assert ideal["tokens_per_second"] == max(m["tokens_per_second"] for m in ideal["by_kernel"])
    table = bench_table.build_table({"seed": 0, "eval_samples": 2}, {
        "grpogate": _result([10.0], 100.0, 2.0, 1.0, valid_groups=6)}, ideal, None)
    printed = bench_table.format_table(table)
    assert f"peak fractions use {ideal['dtype']} {ideal['kernel']}" in printed
    assert all(m["kernel"] in printed for m in ideal["by_kernel"])


def test_linear_shapes_of_the_tiny_llama(tiny_model_dir):
    from decode_ideal import linear_shapes

    shapes = linear_shapes(str(tiny_model_dir))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    # 7 projections per layer plus the LM head, which comes last
    assert len(shapes) == 7 * config["num_hidden_layers"] + 1
    assert shapes[-1] == (config["hidden_size"], config["vocab_size"])


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRL, reason="TRL not installed (pip install -e '.[bench]')")
def test_benchmark_end_to_end_on_the_tiny_model(tiny_model_dir, tmp_path):
    out = tmp_path / "table.json"
    command = [sys.executable, str(BENCH / "grpo_vs_trl.py"), "--model", str(tiny_model_dir),
               "--systems", "grpogate,trl-nogc", "--steps", "1", "--prompts-per-step", "2",
               "--group-size", "4", "--max-new-tokens", "4", "--eval-prompts", "2",
               "--eval-samples", "2", "--lora-r", "4", "--threads", "1", "--ideal-seconds", "0.05",
               "--workdir", str(tmp_path / "work"), "--json", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stderr[-3000:]
    table = json.loads(out.read_text())
    assert set(table["systems"]) == {"grpogate", "trl-nogc"}
    assert table["raw"]["trl-nogc"]["prompt_tokens_match_grpogate"] is True
    assert table["raw"]["grpogate"]["steps"][0]["generated_tokens"] > 0
    assert table["raw"]["trl-nogc"]["steps"][0]["generated_tokens"] > 0
    assert set(table["heldout_mean_reward"]) == {"baseline", "grpogate", "trl-nogc"}
    # cross-checks hold (a note about other work on the machine may remain)
    assert [note for note in table["notes"] if "load average" not in note] == []
    for key in ("effective_trajectories_per_second_ratio", "generation_peak_fraction",
                "peak_rss_ratio"):
        assert key in table


def test_without_trl_its_systems_are_dropped_with_the_install_command(capsys):
    import grpo_vs_trl

    assert grpo_vs_trl.select_systems("grpogate,trl,trl-nogc", trl_installed=False) == ["grpogate"]
    assert "pip install -e '.[bench]'" in capsys.readouterr().err
    assert grpo_vs_trl.select_systems("trl", trl_installed=True) == ["trl"]
    with pytest.raises(SystemExit, match="unknown"):
        grpo_vs_trl.select_systems("grpogate,verl", trl_installed=True)


def test_a_ratio_over_a_zero_trl_value_is_undefined_and_meets_no_target():
    results = {"grpogate": _result([10.0], 300.0, 2.0, 1.0, valid_groups=6),
               "trl": _result([50.0], 100.0, 0.0, 2.0, valid_groups=0)}
    ideal = {"tokens_per_second": 600.0, "dtype": "float32", "batch_size": 64, "linear_maps": 211,
             "by_dtype": {"float32": {"tokens_per_second": 600.0}}}
    table = bench_table.build_table({"seed": 0, "eval_samples": 2}, results, ideal, None)
    assert table["effective_trajectories_per_second_ratio"] is None
    assert table["targets"]["effective_trajectories_per_second_ratio >= 4"] is False
    assert table["peak_rss_ratio"] == pytest.approx(0.5)


def test_a_failed_child_is_reported_not_fatal(tmp_path):
    import grpo_vs_trl

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"threads": 1}))
    assert grpo_vs_trl.run_child("no-such-system", spec, tmp_path / "child", threads=1) is None


GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


@pytest.mark.skipif(not GSM8K_DIR.is_dir(), reason=f"GSM8K not found at {GSM8K_DIR}")
def test_gpu_check_runs_end_to_end_on_a_tiny_qwen2(tiny_model_dir, tmp_path):
    """The script prepared for the GPU machine, at --tiny sizes on the CPU: a random Qwen2 (the
    GPU run's architecture, with its 151,936-token vocabulary), the forced reward pattern, and
    the figures the check reports."""
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), "--tokenizer", str(tiny_model_dir),
         "--gsm8k", str(GSM8K_DIR), "--out", str(tmp_path / "check"), "--tiny"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout[done.stdout.index("{"):])
    assert report["tiny"] is True and report["steps"] == 1
    assert report["update_count"] == 4  # 4 prompts, every group valid, one update per group
    # Qwen2 takes the lean decoder, its step native where the kernels build here
    import torch

    from grpogate.engines.cpu.native import native_kernels

    native = native_kernels(torch.bfloat16, torch.device("cpu")) is not None
    assert report["decode_paths"] == ["lean-native" if native else "lean"]
    assert report["generated_tokens"] > 0 and report["generation_tokens_per_second"] > 0
    assert report["peak_allocated_gib"] > 0
    evidence = json.loads((tmp_path / "check" / "run" / "evidence.json").read_text())
    assert evidence["config"]["model"].endswith("model") and evidence["status"] == "ok"
    # the gate of the delivered adapter through `gate --candidate`'s door, judged by decide's rule
    gated = report["gate_candidate"]
    gate_evidence = json.loads((tmp_path / "check" / "gate" / "evidence.json").read_text())
    assert gated["decision"] == gate_evidence["decision"]["decision"]
    assert gated["failed_checks"] == gate_evidence["decision"]["failed_checks"]
    gate_dir = tmp_path / "check" / "gate"
    stored = sum(len((gate_dir / name).read_text().splitlines())
                 for name in ("eval_completions.jsonl", "guard_completions.jsonl")
                 if (gate_dir / name).is_file())
    assert gated["retest_completions"] == stored > 0
    assert gated["retest_tokens_per_second"] > 0 and gated["peak_allocated_gib"] > 0
    assert (tmp_path / "check" / "gate" / "manifest.json").is_file()


def test_decode_bound_records_the_rollout_it_times_without_changing_it(tiny_config, tmp_path):
    from decode_bound import TimedStepper

    from grpogate.engines import engine_for
    from grpogate.engines.rows import ROW_BUCKET
    from grpogate.inputs.policy import load_policy, sampling_weights
    from grpogate.sampling.rollout import SamplingSettings, generate_completions

    policy = load_policy(tiny_config(tmp_path), seed=0)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    settings = SamplingSettings(max_new_tokens=12, temperature=1.0, top_p=1.0, batch_size=64)
    log = []
    with sampling_weights(policy):
        plain = generate_completions(policy.model, policy.tokenizer, prompts, 8, settings, seed=5)
        timed = generate_completions(policy.model, policy.tokenizer, prompts, 8, settings, seed=5,
                                     stepper=TimedStepper(engine_for(policy.model).stepper(policy.model), log))
    assert [c.completion_token_ids for c in timed] == [c.completion_token_ids for c in plain]
    kinds = [kind for kind, _, _ in log]
    assert kinds[0] == "prefill" and log[0][1] == (0, 3 * 16)  # no shared prefix; 3 x width 16
    rows = [r for kind, r, _ in log if kind == "step"]
    assert rows and rows[0] == 24 and rows == sorted(rows, reverse=True)
    assert all(r % ROW_BUCKET == 0 for r in rows[1:] if r < 24)
    assert all(seconds > 0 for _, _, seconds in log)
    # every token after the prefill's first one came from a decode step on a row that held it
    assert sum(len(c.completion_token_ids) for c in timed) <= 24 + sum(rows)


def test_update_bound_counts_useful_and_executed_work_by_hand():
    """The hand batch of test_packing: prompts of 20 and 15 tokens (10 shared), completions
    of 4, 2 / 6, 1 tokens, one micro-batch."""
    import update_bound
    from test_packing import hand_batch

    from grpogate.training.batching import ForwardShape
    from grpogate.training.update import UpdateSettings

    shape, settings = ForwardShape(per_token=1000, per_pair=0, per_logit=100), UpdateSettings()
    padded = update_bound.work_counts(hand_batch(), settings, shape, "padded", 2)
    packed = update_bound.work_counts(hand_batch(), settings, shape, "packed", 2)
    # useful: 20 + 15 prompt tokens + 3 + 1 + 5 + 0 completion inputs = 44; 13 predicted tokens
    assert padded["useful"] == packed["useful"] == [44, 13]
    assert padded["micro_batches"] == [(44, 13)]
    # padded: 2 x 32 + 4 x 15 = 124 positions, 4 x 16 = 64 logits (real: 44 and 13);
    # packed: 34 real positions padded to 48, logits at 11 distinct positions (all real)
    assert (padded["executed"], padded["executed_real"]) == ([124, 64], [44, 13])
    assert (packed["executed"], packed["executed_real"]) == ([48, 11], [34, 11])
    # 2 x 3 passes x (44 x 1000 + 13 x 100) = 271,800
    assert update_bound.flops([44, 13], shape, 3) == 271_800


def test_update_bound_runs_on_a_recorded_tiny_run(tiny_model_dir, tmp_path):
    from synthetic_run import write_synthetic_run

    run_dir = write_synthetic_run(tmp_path)  # 2 steps of 2 prompts x G = 4, rewards recorded
    out = tmp_path / "bound.json"
    command = [sys.executable, str(BENCH / "update_bound.py"), "--run-dir", str(run_dir),
               "--steps", "0", "--group-size", "4", "--rounds", "1", "--threads", "1",
               "--layouts", "packed,padded", "--set", f"model={tiny_model_dir}", "--json", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    report = json.loads(out.read_text())
    for key in ("update_useful_peak_fraction", "update_padding_fraction", "update_seconds",
                "ideal_seconds"):
        assert report[key] > 0
    packed, padded = report["layouts"]["packed"], report["layouts"]["padded"]
    assert report["layout"] == "packed" and report["update_seconds"] == packed["update_seconds"]
    assert packed["tokens_trained"] == padded["tokens_trained"] > 0  # the same groups trained
    assert packed["update_padding_fraction"] < padded["update_padding_fraction"]
    assert packed["tokens_forwarded"] < padded["tokens_forwarded"]
    # the printed table: a row per layout and the headline, the same numbers as the JSON
    rows = {line.split()[0]: line.split() for line in finished.stdout.splitlines() if line.split()}
    assert rows["packed"][1] == f"{packed['update_seconds']:.2f}"
    assert rows["padded"][-1] == f"{padded['update_useful_peak_fraction']:.3f}"
    assert f"update_useful_peak_fraction (packed): {report['update_useful_peak_fraction']:.3f}" in finished.stdout


def test_update_bound_refuses_forged_trajectory_records(tiny_model_dir, tmp_path):
    """A run directory is untrusted: a recorded length sets how many tokens the script builds."""
    import update_bound
    from synthetic_run import write_synthetic_run
    from transformers import AutoTokenizer

    run_dir = write_synthetic_run(tmp_path)
    path = run_dir / "trajectories.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def rollouts(max_tokens=48):
        return update_bound.recorded_rollouts(str(run_dir), tokenizer, "", 256, 2, 0, max_tokens)

    got = rollouts()  # the records as written: 2 steps of 2 prompts x G = 4, lengths as recorded
    assert [len(completions) for _, completions, _ in got] == [8, 8]
    assert [len(c) for c in got[0][1]] == [r["completion_tokens"] for r in records[:8]]
    lengths = [r["completion_tokens"] for r in records]
    first_longest = lengths.index(max(lengths)) + 1  # records count from 1
    with pytest.raises(SystemExit, match=f"record {first_longest}: field completion_tokens "
                                         f"{max(lengths)} is not an integer in 0..{max(lengths) - 1}"):
        rollouts(max(lengths) - 1)  # a budget smaller than what the run recorded
    for field, value, message in (("completion_tokens", 10 ** 12, "field completion_tokens 1000000000000 is not"),
                                  ("completion_tokens", "5", "field completion_tokens '5' is not"),
                                  ("prompt_id", "forged", "field prompt_id 'forged' is not a prompt"),
                                  ("step", "1e9", "field step '1e9' is not int"),
                                  ("reward", True, "field reward True is not int or float"),
                                  ("completion", None, "field completion None is not str")):
        forged = records[:2] + [records[2] | {field: value}] + records[3:]
        path.write_text("".join(json.dumps(r) + "\n" for r in forged))
        with pytest.raises(SystemExit, match=f"^error: {re.escape(str(path))}: record 3: {re.escape(message)}"):
            rollouts()


class _HandProducts:
    """A layers' row costs 1 s, an LM head row 100 s: every count below is readable."""

    def seconds(self, part, rows):
        return rows * (1 if part == "layers" else 100)

    def step(self, rows, head_rows=None):
        return self.seconds("layers", rows) + self.seconds("head", rows if head_rows is None else head_rows)


def test_workload_bound_counts_prefill_and_the_rows_each_decode_step_still_runs():
    import workload_bound

    prompts, shared = [[1, 2, 3, 4], [1, 2, 3, 5, 6]], 3  # own tokens: 1 and 2
    lengths = [[3, 1], [2, 2]]  # G = 2 completion lengths per prompt
    # One batch of both prompts (4 rows): prefill = prefix 3 + own 1 + 2 = 3 layer rows,
    # head on 2 prompts: 3 + 3 + 200 = 206; decode position 1: lengths > 1 are 3, 2, 2 ->
    # 3 rows: 3 + 300 = 303; position 2: only the 3 -> 1 row: 101. 206 + 303 + 101 = 610.
    assert workload_bound.generation_seconds(_HandProducts(), prompts, lengths, 2, 4, shared) == 610
    # Batches of one prompt (2 rows): 3 + 1 + 100 = 104, then [3, 1]: 101 and 101 -> 306;
    # 3 + 2 + 100 = 105, then [2, 2]: 2 rows at position 1 -> 202 -> 307. 306 + 307 = 613.
    assert workload_bound.generation_seconds(_HandProducts(), prompts, lengths, 2, 2, shared) == 613


def test_workload_bound_interpolates_between_the_timed_row_counts():
    import workload_bound

    products = object.__new__(workload_bound.Products)  # timings given, nothing timed here
    products.timed = {(part, g): 2 * g + 1 for part in ("layers", "head") for g in workload_bound.GRID}
    assert products.seconds("layers", 16) == 33  # on the grid: 2 x 16 + 1
    assert products.seconds("layers", 12) == 25  # halfway between 8 (17) and 16 (33)
    assert products.seconds("layers", 3) == 7  # halfway between 2 (5) and 4 (9)
    assert products.seconds("head", 512) == 513 * 2  # beyond 256 rows: 256's per-row cost
    assert products.seconds("layers", 0) == 0
    assert products.step(12, head_rows=3) == 25 + 7


def test_workload_bound_refuses_lengths_beyond_the_budget_and_prompts_outside_the_set():
    """A run directory is untrusted: its lengths set the script's work."""
    from workload_bound import grouped

    good = {"prompt_id": "a", "completion_tokens": 3, "policy": "baseline"}
    assert grouped([good, good | {"completion_tokens": 48}], lambda r: r["policy"], "x.jsonl", 48,
                   {"a"}) == {"baseline": {"a": [3, 48]}}
    for bad, message in (({"completion_tokens": 49}, "record 2: field completion_tokens 49 is not"),
                         ({"completion_tokens": 10 ** 12}, "record 2: field completion_tokens 1000000000000"),
                         ({"completion_tokens": True}, "record 2: field completion_tokens True is not"),
                         ({"completion_tokens": "5"}, "record 2: field completion_tokens '5' is not"),
                         ({"prompt_id": "b"}, "record 2: field prompt_id 'b' is not a prompt")):
        with pytest.raises(SystemExit, match="^error: x.jsonl: " + re.escape(message)):
            grouped([good, good | bad], lambda r: r["policy"], "x.jsonl", 48, {"a"})


def test_workload_bound_runs_on_a_recorded_tiny_run(tiny_model_dir, tmp_path):
    from synthetic_run import write_synthetic_run

    run_dir = write_synthetic_run(tmp_path, guard_rewards={"baseline": [[1, 0, 1, 1], [0, 0, 1, 0]],
                                                           "candidate": [[1, 1, 1, 1], [0, 1, 1, 0]]})
    out = tmp_path / "bound.json"
    command = [sys.executable, str(BENCH / "workload_bound.py"), "--run-dir", str(run_dir),
               "--model", str(tiny_model_dir), "--threads", "1", "--json", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    report = json.loads(out.read_text())
    stages = report["stages"]
    recorded = json.loads((run_dir / "evidence.json").read_text())["timings"]
    assert stages["rollout"]["recorded_seconds"] == round(recorded["rollout_seconds"], 2)
    for stage in ("rollout", "update", "re-test"):  # every computing stage has products
        assert stages[stage]["products_seconds"] > 0
    assert stages["load"]["products_seconds"] == stages["checkpoints"]["products_seconds"] == 0
    passes = report["re-test_products_by_pass"]
    assert set(passes) == {"eval", "guard"} and set(passes["guard"]) == {"baseline", "candidate"}
    # the synthetic records carry the drift: the candidate's completions go through twice
    assert passes["eval"]["baseline on the candidate's"] == passes["eval"]["candidate"]
    total = sum(row["products_seconds"] for row in stages.values())
    assert abs(report["total"]["products_seconds"] - total) < 0.02  # the rows rounded to 0.01
    assert "total" in finished.stdout and "re-test" in finished.stdout


@pytest.mark.parametrize("field", ["model", "adapter"])
def test_bench_scripts_refuse_a_model_or_adapter_the_run_directory_brings(tmp_path, field):
    """workload_bound and transfer_check rebuild a run from its stored config; a model or
    baseline adapter path inside the run directory is refused before anything loads."""
    from synthetic_run import write_synthetic_run

    run_dir = write_synthetic_run(tmp_path)
    planted = run_dir / "adapter" / "x\x1b[2J"  # inside the run directory, its name hostile
    planted.mkdir()
    evidence = json.loads((run_dir / "evidence.json").read_text())
    evidence["config"][field] = str(planted)
    (run_dir / "evidence.json").write_text(json.dumps(evidence))
    shown = str(planted).replace("\x1b", "\\x1b")  # printed as text, never the raw ESC
    message = f"field config.{field}: {shown} is inside the run directory"
    command = [sys.executable, str(BENCH / "workload_bound.py"), "--run-dir", str(run_dir),
               "--threads", "1"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 1 and message in finished.stderr
    assert finished.stderr.startswith("error: ") and "Traceback" not in finished.stderr
    assert "\x1b" not in finished.stderr
    finished = subprocess.run([sys.executable, str(BENCH / "transfer_check.py"), str(run_dir),
                               "--record", str(tmp_path / "record.jsonl")],
                              capture_output=True, text=True, timeout=600)
    assert finished.returncode == 1 and message in finished.stderr
    assert "\x1b" not in finished.stderr
    assert not (tmp_path / "record.jsonl").exists()


@pytest.mark.parametrize("damaged", ["evidence.json", "trajectories.jsonl"])
def test_the_bounds_name_a_damaged_run_file_in_one_error_line(tiny_model_dir, tmp_path, damaged):
    """update_bound and workload_bound read a stranger's run directory: a file that is not
    JSON is one `error:` line naming it (and the line, for JSONL), never a traceback."""
    from synthetic_run import write_synthetic_run

    run_dir = write_synthetic_run(tmp_path)
    path = run_dir / damaged
    if damaged == "evidence.json":
        path.write_text("{not json")
        where = str(path)
    else:
        lines = path.read_text().count("\n")
        path.write_text(path.read_text() + "{not json\n")
        where = f"{path}:{lines + 1}"
    commands = {
        "update_bound": [sys.executable, str(BENCH / "update_bound.py"), "--run-dir", str(run_dir),
                         "--steps", "0", "--group-size", "4", "--rounds", "1", "--threads", "1",
                         "--set", f"model={tiny_model_dir}"],
        "workload_bound": [sys.executable, str(BENCH / "workload_bound.py"), "--run-dir",
                           str(run_dir), "--model", str(tiny_model_dir), "--threads", "1"]}
    if damaged == "evidence.json":  # update_bound reads it only for a run without problems.jsonl
        del commands["update_bound"]
    for name, command in commands.items():
        finished = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert finished.returncode == 1, (name, finished.stderr[-2000:])
        last = finished.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: {where}") and "Traceback" not in finished.stderr, (name, last)


def test_update_share_is_update_seconds_over_step_seconds():
    result = _result([10.0, 30.0], 100.0, 1.0, 1.0, valid_groups=2)
    result["steps"][0]["update_seconds"], result["steps"][1]["update_seconds"] = 6.0, 14.0
    # (6 + 14) / (10 + 30) = 0.5
    assert bench_table.system_row(result, None, 1.0)["update_share_of_step"] == 0.5
    # a result without the per-step update seconds (an older table) shows no share
    assert bench_table.system_row(_result([10.0], 1.0, 1.0, 1.0, 1), None, 1.0)["update_share_of_step"] is None


def test_lora_adds_no_activation_copy_in_float32(tiny_model_dir):
    command = [sys.executable, str(BENCH / "lora_casts.py"), "--model", str(tiny_model_dir),
               "--dtypes", "float32"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    counts = json.loads(finished.stdout)["float32"]
    on, off = counts["adapter_on"], counts["adapter_off"]
    extra, extra_scalar = on["copies"] - off["copies"], on["scalar_copies"] - off["scalar_copies"]
    assert extra == extra_scalar == counts["lora_layers"]  # one 0-dim copy per LoRA layer, no more
