"""End to end on the real bundled SmolLM2-135M-Instruct: `grpogate run --profile smoke`.

The run is conftest's session-wide `smoke_run` (about 20 s on 2 CPU cores; the first call also
dequantizes the GGUF into the cache), shared with test_thread_invariance. It checks what the
issue's "done when" asks: exit 0, and evidence, manifest, trajectories and adapter files that
agree with each other.
"""

import json
import subprocess
import sys
import time

import pytest
from helpers import sha256

pytestmark = pytest.mark.slow


def test_the_dry_runs_time_forecast_is_within_twice_the_smoke_runs_wall_time(smoke_run):
    """Issue 60: the dry run's expected seconds, from its measurement of this machine, within a
    factor of 2 of the run's measured wall time (both on this machine, in this test); the upper
    figure is above the expected one."""
    *_, timing = smoke_run
    forecast = timing["dry_run"]["time_estimate"]
    expected = forecast["expected_seconds"]["total"]
    print(f"forecast {expected:.1f} s (upper {forecast['upper_seconds']['total']:.1f}), "
          f"measured {timing['wall']:.1f} s: ratio {expected / timing['wall']:.2f}")
    assert 0.5 <= expected / timing["wall"] <= 2.0, (expected, timing["wall"], forecast)
    assert forecast["upper_seconds"]["total"] > expected
    assert forecast["assumed"]["dtype"] in ("bfloat16", "float32")


def test_the_dry_runs_expected_peak_is_near_the_smoke_runs_peak(smoke_run):
    """The expected peak memory against the run's own peak RSS: within 25 % on the AMX class
    (docs/measurements.md, "The dry run's forecast"); a factor of 1.5 here, for other classes."""
    out, *_, timing = smoke_run
    evidence = json.loads((out / "evidence.json").read_text())
    expected = timing["dry_run"]["memory_estimate_gib"]["expected_peak"] * 2**30
    measured = evidence["resources"]["peak_rss_bytes"]
    print(f"expected peak {expected / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB")
    assert 1 / 1.5 <= expected / measured <= 1.5, (expected, measured)


def test_smoke_run_writes_consistent_evidence(smoke_run):
    out, stdout, *_ = smoke_run
    evidence = json.loads((out / "evidence.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    trajectories = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    eval_records = [json.loads(line) for line in (out / "eval_completions.jsonl").read_text().splitlines()]
    config = evidence["config"]

    assert evidence["inputs"]["model"]["kind"] == "gguf"
    assert len(trajectories) == config["train_prompts"] * config["group_size"]
    assert len({t["trace_id"] for t in trajectories}) == len(trajectories)
    assert {t["verifier_version"] for t in trajectories} == {"reasoning-gym/chain_sum-v2"}
    assert all(t["reward"] in (0.0, 1.0) for t in trajectories)
    assert len(eval_records) == 2 * config["eval_prompts"] * config["eval_group_size"]

    adapter_file = out / "adapter" / "adapter_model.safetensors"
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert manifest["adapter"]["sha256"] == sha256(adapter_file) == evidence["artifact"]["sha256"]
    for name, digest in manifest["files"].items():
        assert sha256(out / name) == digest, name
    assert manifest["decision"] in ("accept", "tune", "reject")
    assert manifest["decision"] == evidence["decision"]["decision"]
    assert f"decision: {manifest['decision']}" in stdout
    text = " ".join(stdout.split())  # rich wraps long lines at the terminal width
    assert "profile smoke: a pipeline check" in text  # what the profile is for, with its decision
    assert "gain gates (reward, pass_at_group) pass when an anytime-valid one-sided test" in text
    assert manifest["rollback_source"]["policy_version"] == evidence["inputs"]["baseline_policy_version"]
    assert manifest["new_policy_version"] != manifest["source_policy_version"]
    for key in ("rollout_seconds", "verification_seconds", "update_seconds", "evaluation_seconds"):
        assert evidence["timings"][key] >= 0
    assert evidence["resources"]["peak_rss_bytes"] > 100 * 2**20  # the model alone is ~270 MB


def test_decide_agrees_with_the_smoke_run(smoke_run):
    out, *_ = smoke_run
    result = subprocess.run([sys.executable, "-m", "grpogate.cli", "decide", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["decision"] in result.stdout


def test_smoke_run_is_portable_and_quiet(smoke_run):
    """The adapter names SmolLM2 by its public id, the problems travel with the run, and the
    terminal shows no library noise (weights-loading bar, transformers FutureWarning)."""
    out, stdout, stderr, _ = smoke_run
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    manifest = json.loads((out / "manifest.json").read_text())
    assert "problems.jsonl" in manifest["files"]
    assert "Loading weights" not in stdout + stderr, stderr[-3000:]
    assert "FutureWarning" not in stdout + stderr, stderr[-3000:]


def test_a_run_that_changes_nothing_is_rejected(tmp_path):
    """At learning rate 1e-12 the adapter's update is far below bf16's resolution, so the
    candidate answers the re-test exactly as the baseline does (same seeds): status
    no_effective_update, `reject`, and the words for it in the output and in `decide`."""
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "grpogate.cli", "run", "--profile", "smoke", "--lr", "1e-12",
         "--exit-code-from-decision", "--out", str(out)], capture_output=True, text=True,
        timeout=900)
    assert result.returncode == 4, result.stdout[-3000:] + result.stderr[-3000:]
    evidence = json.loads((out / "evidence.json").read_text())
    assert evidence["status"] == "no_effective_update"
    assert evidence["decision"]["decision"] == "reject"
    assert "effective_update" in evidence["decision"]["failed_checks"]
    identical = evidence["comparison"]["identical_completions"]
    assert identical["pairs"] == identical["identical"] == 32  # 8 prompts x 4 samples
    text = " ".join(result.stdout.split())
    assert ("the candidate's re-test completions are identical to the baseline's (32 of 32 eval "
            "pairs, 32 of 32 guard pairs): no effective update") in text
    decided = subprocess.run([sys.executable, "-m", "grpogate.cli", "decide", str(out)],
                             capture_output=True, text=True, timeout=300)
    assert decided.returncode == 0, decided.stdout[-3000:]
    assert "identical to the baseline's" in " ".join(decided.stdout.split())
