"""`grpogate decide --replay N`: a forged completion with every hash recomputed survives the
plain audit and is caught by regenerating it from the delivered artifacts."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from grpogate import pipeline
from grpogate.cli import app
from grpogate.evidence.audit import audit_run
from grpogate.evidence.manifest import build_manifest
from grpogate.evidence.metrics import identical_pairs
from grpogate.review import replay
from grpogate.files import atomic_write_bytes, atomic_write_json, jsonl_bytes, read_jsonl
from grpogate.review.replay import replay_prompt_count, replay_retest


def test_replay_reproduces_the_retest_and_catches_a_forged_completion(tiny_config, tmp_path,
                                                                     monkeypatch):
    config = tiny_config(tmp_path)
    run_dir = pipeline.run(config)["run_dir"]
    # 16 rows per decode batch / 2 samples per prompt = 8 prompts a batch: 1 rounds up to the
    # whole first batch, here all 4 eval prompts.
    assert replay_prompt_count(config, 1) == 4
    replayed = replay_retest(run_dir, 1)
    assert replayed["environment_matches"] is True
    assert replayed["compared"] == replayed["equal"] == 4 * 2 * 2  # prompts x samples x policies
    assert replayed["mismatches"] == []

    # The forgery: one completion rewritten (its reward unchanged: a trailing space does not
    # move the final number), every hash recomputed. The plain audit has nothing to find.
    records = read_jsonl(f"{run_dir}/eval_completions.jsonl")
    # The forger rewrites both policies' completions of one (prompt, sample) pair alike, so
    # the count of identical pairs the evidence records (rebuilt by the audit) still holds.
    partner = next(i for i, r in enumerate(records) if r["policy"] != records[0]["policy"]
                   and (r["prompt_id"], r["sample_index"]) == (records[0]["prompt_id"],
                                                               records[0]["sample_index"]))
    for index in (0, partner):
        records[index]["completion"] += " "
    assert identical_pairs(records) == identical_pairs(
        read_jsonl(f"{run_dir}/eval_completions.jsonl"))
    atomic_write_bytes(f"{run_dir}/eval_completions.jsonl", jsonl_bytes(records))
    evidence = json.loads(open(f"{run_dir}/evidence.json").read())
    trajectories = read_jsonl(f"{run_dir}/trajectories.jsonl")
    atomic_write_json(f"{run_dir}/manifest.json", build_manifest(evidence, Path(run_dir),
                                                                 trajectories))
    assert audit_run(run_dir)["mismatches"] == []
    result = CliRunner().invoke(app, ["decide", run_dir, "--replay", "1"])
    assert result.exit_code == 4, result.output
    assert "14/16 completions equal to the stored ones (environment as recorded)" in result.output
    assert "mismatch replay eval_completions.jsonl:1 completion" in result.output

    # Elsewhere (another torch), bit-identity is not promised: the agreement is reported only.
    real = replay.library_versions
    monkeypatch.setattr(replay, "library_versions", lambda: {**real(), "torch": "0.0-other"})
    elsewhere = replay_retest(run_dir, 1)
    assert elsewhere["environment_matches"] is False and elsewhere["mismatches"] == []
    assert elsewhere["environment_differences"]["torch"]["now"] == "0.0-other"
    assert elsewhere["equal"] == 14


def test_a_replay_without_the_runs_native_kernels_reports_rather_than_rejects(
        tiny_config, tmp_path, monkeypatch):
    """The run recorded which native build decoded (or "none"); a replay where another build,
    or none, would decode says so and rejects nothing on the samples."""
    run_dir = pipeline.run(tiny_config(tmp_path))["run_dir"]
    import torch

    recorded = json.loads(open(f"{run_dir}/evidence.json").read())["environment"]
    assert recorded["native_kernels"] == replay.kernels_identity(torch.float32,
                                                                 torch.device("cpu"))
    monkeypatch.setattr(replay, "kernels_identity", lambda dtype, device: "kernels-elsewhere")
    elsewhere = replay_retest(run_dir, 1)
    assert elsewhere["environment_matches"] is False and elsewhere["mismatches"] == []
    assert elsewhere["environment_differences"]["native_kernels"] == {
        "recorded": recorded["native_kernels"], "now": "kernels-elsewhere"}
