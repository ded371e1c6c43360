"""`grpogate decide`: an untouched run agrees with itself; every kind of tampering is named."""

import json

import pytest
from synthetic_run import write_synthetic_run
from typer.testing import CliRunner

from grpogate.evidence import decisions
from grpogate.evidence import metrics
from grpogate.evidence.audit import audit_run, same_value
from grpogate.cli import app
from grpogate.evidence.manifest import build_manifest
from grpogate.files import atomic_write_json, read_jsonl


@pytest.fixture
def run_dir(tmp_path):
    return write_synthetic_run(tmp_path)


def fields(audit):
    return [m["field"] for m in audit["mismatches"]]


def rewrite_line(path, number, **changes):
    lines = path.read_text().splitlines()
    record = json.loads(lines[number - 1])
    record.update(changes)
    lines[number - 1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")


def test_untouched_run_agrees(run_dir):
    audit = audit_run(run_dir)
    assert audit["mismatches"] == []
    assert audit["agrees"] is True
    assert audit["decision"] == audit["recorded_decision"] == "accept"
    result = CliRunner().invoke(app, ["decide", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "agrees with the run's own decision" in result.output


def test_flipped_training_reward_is_named(run_dir):
    # Line 5 is step 0, second prompt, sample 0: its group [0,0,0,0] becomes [1,0,0,0], valid.
    rewrite_line(run_dir / "trajectories.jsonl", 5, reward=1.0)
    audit = audit_run(run_dir)
    assert audit["decision"] == "reject" and audit["agrees"] is False
    named = fields(audit)
    for field in ("trajectories.jsonl:5 reward", "files.trajectories.jsonl sha256",
                  "rollout.reward_groups", "rollout.valid_group_ratio",
                  "rollout.effective_trajectory_count", "steps[0].valid_group_count"):
        assert field in named
    flipped = next(m for m in audit["mismatches"] if m["field"] == "trajectories.jsonl:5 reward")
    assert (flipped["recorded"], flipped["recomputed"]) == (1.0, 0.0)
    result = CliRunner().invoke(app, ["decide", str(run_dir)])
    assert result.exit_code == 4
    assert "trajectories.jsonl:5 reward" in result.output
    assert "decision: reject" in result.output


def test_forgery_with_consistent_hashes_is_caught_by_the_verifier(run_dir):
    """Flip a reward and re-derive every summary, the decision and the manifest: only
    re-running the verifier on the stored completion can notice."""
    path = run_dir / "trajectories.jsonl"
    rewrite_line(path, 5, reward=1.0)
    trajectories = read_jsonl(path)
    evidence = json.loads((run_dir / "evidence.json").read_text())
    evidence["rollout"].update(metrics.rollout_summary(trajectories, 4))
    step = metrics.rollout_summary([r for r in trajectories if r["step"] == 0], 4)
    evidence["steps"][0].update({k: step[k] for k in ("mean_reward", "valid_group_count",
                                                      "valid_group_ratio")})
    gates = evidence["config"]["gates"]
    candidate = decisions.evaluate_grpo_candidate(evidence, gates)
    for key in ("valid_group_ratio", "effective_trajectory_count",
                "effective_trajectories_per_second"):
        evidence[key] = candidate[key]
    evidence["decision"] = decisions.decide_run(evidence, gates)
    atomic_write_json(run_dir / "evidence.json", evidence)
    atomic_write_json(run_dir / "manifest.json", build_manifest(evidence, run_dir, trajectories))
    assert fields(audit_run(run_dir)) == ["trajectories.jsonl:5 reward"]


def test_edited_evidence_is_a_hash_mismatch(run_dir):
    evidence = json.loads((run_dir / "evidence.json").read_text())
    evidence["resources"]["peak_reserved_bytes"] = 1  # in no check: only the hash knows
    (run_dir / "evidence.json").write_text(json.dumps(evidence, indent=2))
    audit = audit_run(run_dir)
    assert audit["decision"] == "reject"
    assert fields(audit) == ["files.evidence.json sha256",
                             "manifest.trajectory_identity.evidence_sha256"]


def test_edited_decision_is_named(run_dir):
    evidence = json.loads((run_dir / "evidence.json").read_text())
    evidence["decision"]["checks"][5]["passed"] = False
    (run_dir / "evidence.json").write_text(json.dumps(evidence, indent=2))
    assert "decision.checks[5].passed" in fields(audit_run(run_dir))


def test_tampered_adapter_and_missing_manifest(run_dir):
    (run_dir / "adapter" / "adapter_model.safetensors").write_bytes(b"other weights")
    named = fields(audit_run(run_dir))
    assert "files.adapter/adapter_model.safetensors sha256" in named
    assert "artifact.sha256" in named
    (run_dir / "manifest.json").unlink()
    assert fields(audit_run(run_dir))[0] == "manifest.json (missing: the run did not complete)"


def test_flipped_eval_reward_is_named(run_dir):
    # Line 1 is the baseline's first sample of the first eval prompt (reward 0).
    rewrite_line(run_dir / "eval_completions.jsonl", 1, reward=1.0)
    named = fields(audit_run(run_dir))
    assert "eval_completions.jsonl:1 reward" in named
    assert "comparison.baseline.mean_reward" in named
    assert "comparison.paired.reward_mean_gain.point" in named


def test_changed_dataset_file_is_named(run_dir, tmp_path):
    data = tmp_path / "data" / "train.jsonl"
    data.write_text(data.read_text().replace("#### 25", "#### 26"))
    named = fields(audit_run(run_dir))
    assert "inputs.train_set.sha256" in named
    assert "inputs.train_set.problem_set_sha256" in named
    # The last train prompt's one correct completion (line 14) no longer scores 1.
    assert "trajectories.jsonl:14 reward" in named


def test_not_a_run_directory(tmp_path):
    result = CliRunner().invoke(app, ["decide", str(tmp_path)])
    assert result.exit_code == 2
    assert "no evidence.json" in result.output


def test_json_output_lists_the_audit(run_dir):
    result = CliRunner().invoke(app, ["decide", str(run_dir), "--json"])
    assert result.exit_code == 0
    audit = json.loads(result.output)
    assert audit["decision"] == "accept" and audit["mismatches"] == []


def test_same_value_is_exact_for_counts_and_tolerant_for_floats():
    assert same_value(3, 3) and not same_value(3, 4)
    assert same_value(0.1 + 0.2, 0.3)  # 5.6e-17 apart
    assert not same_value(0.3, 0.3 + 2e-9)
    assert not same_value(True, 1)  # a bool is not a count
    assert same_value([[0.0, 1.0]], [[0.0, 1.0]]) and not same_value([1, 2], [1])


def test_audit_and_compare_do_not_import_torch(run_dir):
    """Anyone can re-check a run without a model stack: a fresh interpreter audits it and
    compares eval files without torch ever being imported."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from grpogate.evidence.audit import audit_run\n"
            "import grpogate.standalone_eval\n"
            f"assert audit_run({str(run_dir)!r})['agrees']\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_unreadable_files_are_mismatches_not_crashes(run_dir):
    (run_dir / "trajectories.jsonl").write_bytes(b"\xff\xfe not text")
    assert "trajectories.jsonl (not UTF-8 text)" in fields(audit_run(run_dir))
    (run_dir / "evidence.json").write_text("{truncated")
    audit = audit_run(run_dir)
    assert audit["decision"] == "reject" and audit["checks"] == []
    assert audit["mismatches"][0]["field"].startswith("evidence.json (not valid JSON")
    result = CliRunner().invoke(app, ["decide", str(run_dir)])
    assert result.exit_code == 4


def test_sampler_logprobs_of_the_wrong_length_are_named(run_dir):
    path = run_dir / "trajectories.jsonl"
    tokens = json.loads(path.read_text().splitlines()[1])["completion_tokens"]
    rewrite_line(path, 2, sampler_logprobs=[-0.5] * (tokens + 1))  # one value too many
    named = fields(audit_run(run_dir))
    assert "trajectories.jsonl:2 sampler_logprobs" in named
