"""`grpogate decide`: an untouched run agrees with itself; every kind of tampering is named."""

import hashlib
import json
import os
from pathlib import Path

import pytest
from synthetic_run import SYNTHETIC_ADAPTER, safetensors_bytes, write_synthetic_run
from typer.testing import CliRunner

import grpogate
from grpogate.evidence import decisions
from grpogate.evidence import metrics
from grpogate.evidence.assemble import (dynamic_sampling_section, generation_rounds,
                                       recorded_facts, step_summary, update_section,
                                       update_throughput)
from grpogate.evidence.audit import audit_run, same_value
from grpogate.cli import app
from grpogate.errors import InputError
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
    step_records = [r for r in trajectories if r["step"] == 0]
    evidence["steps"][0].update(step_summary(step_records, 4))
    step = evidence["steps"][0]  # the group now valid adds its tokens to the update's count
    step.update(update_throughput(step["tokens"], step["tokens_forwarded"],
                                  step["tokens_forwarded_real"], step["update_seconds"]))
    facts = recorded_facts(evidence)
    evidence["update"] = update_section(evidence["config"], evidence["steps"], facts["seconds"],
                                        facts["micro_batch_size"], facts["oom_retries"])
    for recorded, rebuilt in zip(evidence["steps"][0]["generation_rounds"],
                                 generation_rounds(step_records, 4, evidence["config"]["seed"], 0)):
        recorded.update(rebuilt)
    evidence["rollout"]["dynamic_sampling"] = dynamic_sampling_section(evidence["config"],
                                                                       evidence["steps"])
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


def test_a_file_is_hashed_as_the_audit_read_it(run_dir, monkeypatch):
    """A file that reads one way when parsed and another when hashed (swapped in between, or
    served differently to a second open) must not pass: the audit reads each run file once
    and hashes the bytes it parsed. Here the parse sees evidence.json with one more trailing
    space (the same JSON, other bytes) while the file on disk keeps the pinned bytes."""
    from grpogate.evidence import audit_files

    real = audit_files.read_confined

    def served(root, name):
        data = real(root, name)
        return data + b" " if name == "evidence.json" else data

    monkeypatch.setattr(audit_files, "read_confined", served)
    audit = audit_run(run_dir)
    assert audit["decision"] == "reject"
    assert fields(audit) == ["files.evidence.json sha256",
                             "manifest.trajectory_identity.evidence_sha256"]
    pinned = hashlib.sha256((run_dir / "evidence.json").read_bytes()).hexdigest()
    assert audit["mismatches"][0]["recorded"] == pinned
    assert audit["mismatches"][0]["recomputed"] == hashlib.sha256(
        (run_dir / "evidence.json").read_bytes() + b" ").hexdigest()


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


def test_a_copied_run_decides_without_its_dataset_or_task_generator(run_dir, tmp_path):
    """The run directory alone is enough: copied elsewhere, its dataset deleted and the
    reasoning-gym generator unimportable, a fresh interpreter's audit still agrees."""
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "elsewhere" / "copied-run"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(tmp_path / "data")
    shutil.rmtree(run_dir)
    code = ("import sys\n"
            "sys.modules['reasoning_gym'] = None  # import reasoning_gym now raises ImportError\n"
            "from grpogate.evidence.audit import audit_run\n"
            f"audit = audit_run({str(copy)!r})\n"
            "assert audit['agrees'] and audit['mismatches'] == [], audit['mismatches']\n")
    # The interpreter imports this checkout's grpogate, whatever the working directory.
    source = str(Path(grpogate.__file__).resolve().parents[1])
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=tmp_path,
                   env={**os.environ, "PYTHONPATH": source})


def test_a_changed_reference_answer_is_named(run_dir):
    # problems.jsonl line 4 is the last train prompt (answer 25): its correct completion is
    # trajectories line 14 ("So the total is 25."), which no longer scores 1 against 26.
    path = run_dir / "problems.jsonl"
    record = json.loads(path.read_text().splitlines()[3])
    assert record["split"] == "train" and record["reference"].endswith("#### 25")
    rewrite_line(path, 4, reference=record["reference"].replace("#### 25", "#### 26"))
    named = fields(audit_run(run_dir))
    assert "files.problems.jsonl sha256" in named
    assert "inputs.train_set.problem_set_sha256" in named
    assert "trajectories.jsonl:14 reward" in named


def test_a_prompt_id_that_is_not_its_questions_hash_is_named(run_dir):
    rewrite_line(run_dir / "problems.jsonl", 1, question="A different question?")
    named = fields(audit_run(run_dir))
    assert any(f.startswith("problems.jsonl (problems.jsonl:1: prompt_id") for f in named), named


def test_a_missing_problems_file_is_named(run_dir):
    (run_dir / "problems.jsonl").unlink()
    audit = audit_run(run_dir)
    assert "problems.jsonl (missing)" in fields(audit)
    assert "files.problems.jsonl (missing)" in fields(audit)
    assert audit["decision"] == "reject"


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
            "import grpogate.review.standalone_eval\n"
            f"assert audit_run({str(run_dir)!r})['agrees']\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_unreadable_files_are_mismatches_not_crashes(run_dir):
    (run_dir / "trajectories.jsonl").write_bytes(b"\xff\xfe not text")
    assert "trajectories.jsonl (not UTF-8 text)" in fields(audit_run(run_dir))
    # evidence.json itself: nothing to re-decide from, so bad input (exit 2, as decide's help
    # says), not a decision.
    (run_dir / "evidence.json").write_text("{truncated")
    with pytest.raises(InputError, match=r"evidence.json: unreadable \(not valid JSON: "):
        audit_run(run_dir)
    result = CliRunner().invoke(app, ["decide", str(run_dir)])
    assert result.exit_code == 2 and result.stdout.strip() == ""
    assert result.stderr.startswith(f"error: {run_dir}/evidence.json: unreadable (not valid JSON")
    assert result.stderr.count("\n") == 1
    (run_dir / "evidence.json").write_text('{"decision": {}}')
    result = CliRunner().invoke(app, ["decide", str(run_dir), "--json"])
    assert result.exit_code == 2 and result.stdout.strip() == "", result.output
    assert result.stderr == (f"error: {run_dir}/evidence.json: unreadable (no config: not a "
                             "grpogate evidence file); not a readable run directory\n")


def swap_adapter_and_recompute_hashes(run_dir, values=(9.0, 9.0)):
    """The forgery of issue 16: another adapter in adapter/, every hash recomputed to match."""
    names = list(SYNTHETIC_ADAPTER)
    weights = run_dir / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(safetensors_bytes({names[0]: list(values), names[1]: [1.0, 1.0]}))
    evidence = json.loads((run_dir / "evidence.json").read_text())
    evidence["artifact"]["sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    atomic_write_json(run_dir / "evidence.json", evidence)
    manifest = build_manifest(evidence, run_dir, read_jsonl(run_dir / "trajectories.jsonl"))
    atomic_write_json(run_dir / "manifest.json", manifest)
    return manifest


def test_a_swapped_adapter_with_recomputed_hashes_is_caught_by_its_tensors(run_dir):
    swap_adapter_and_recompute_hashes(run_dir)
    audit = audit_run(run_dir)
    assert audit["decision"] == "reject"
    assert fields(audit) == ["artifact.new_policy_version"] + [
        f"eval_completions.jsonl:{line} policy_version" for line in range(9, 17)]


def test_a_forged_manifest_is_not_admitted_as_a_baseline(run_dir):
    from grpogate.evidence.manifest import read_baseline_manifest

    # Untouched, the manifest is a baseline and names its candidate's recomputed version.
    admitted = read_baseline_manifest(str(run_dir / "manifest.json"))
    assert admitted["policy_version"] == json.loads(
        (run_dir / "manifest.json").read_text())["new_policy_version"]
    swap_adapter_and_recompute_hashes(run_dir)
    with pytest.raises(InputError, match='field "new_policy_version" is .* but the adapter\'s '
                                         'tensors and model.sha256 give'):
        read_baseline_manifest(str(run_dir / "manifest.json"))


def test_a_recorded_baseline_version_that_is_not_the_base_model_is_named(run_dir):
    evidence = json.loads((run_dir / "evidence.json").read_text())
    evidence["inputs"]["baseline_policy_version"] = "f" * 64
    atomic_write_json(run_dir / "evidence.json", evidence)
    assert "inputs.baseline_policy_version" in fields(audit_run(run_dir))


def test_decide_prints_every_gate_the_run_loosened(tmp_path):
    run_dir = write_synthetic_run(tmp_path, minimum_valid_group_ratio=0.0,
                                  maximum_max_length_hit_ratio=1.0, require_significant_gain=True)
    result = CliRunner().invoke(app, ["decide", str(run_dir)])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("non-default gate")]
    assert lines == ["non-default gate minimum_valid_group_ratio = 0.0 (default 0.2)",
                     "non-default gate maximum_max_length_hit_ratio = 1.0 (default 0.5)"]
    audit = audit_run(run_dir)
    assert audit["non_default_gates"]["minimum_valid_group_ratio"] == {"value": 0.0,
                                                                       "default": 0.2}


@pytest.mark.parametrize("damage, message", [
    (lambda run: (run / "adapter" / "nested").mkdir(),
     "adapter/nested: not a file; a run's adapter/ holds only the adapter's files"),
    (lambda run: (run / "evidence.json").write_text("[" * 100_000 + "]" * 100_000),
     "evidence.json: JSON nested deeper than 64 levels; not a file grpogate reads"),
    (lambda run: (run / "trajectories.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n"),
     "trajectories.jsonl:1: JSON nested deeper than 64 levels; not a file grpogate reads"),
], ids=["directory inside adapter/", "deeply nested evidence", "deeply nested record"])
def test_decide_on_a_malformed_run_directory_is_one_error_line(run_dir, damage, message):
    damage(run_dir)
    result = CliRunner().invoke(app, ["decide", str(run_dir)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert result.stdout.strip() == ""


def test_a_tampered_reward_component_or_its_version_is_named(run_dir):
    """The audit re-scores every component with the run's reward functions: a component
    changed in a record, or a component version changed, is named even when the total and
    every summary still agree."""
    path = run_dir / "trajectories.jsonl"
    record = json.loads(path.read_text().splitlines()[2])
    rewrite_line(path, 3, rewards={"correctness": 1.0 - record["rewards"]["correctness"]},
                 reward=record["reward"])
    rewrite_line(path, 4, reward_versions={"correctness": "gsm8k-final-number-v0"})
    found = fields(audit_run(run_dir))
    assert "trajectories.jsonl:3 rewards.correctness" in found
    assert "trajectories.jsonl:3 reward" not in found  # the total itself was left as scored
    assert "contract.admitted" in found  # line 4's component version breaks its step contract


def test_sampler_logprobs_of_the_wrong_length_are_named(run_dir):
    path = run_dir / "trajectories.jsonl"
    tokens = json.loads(path.read_text().splitlines()[1])["completion_tokens"]
    rewrite_line(path, 2, sampler_logprobs=[-0.5] * (tokens + 1))  # one value too many
    named = fields(audit_run(run_dir))
    assert "trajectories.jsonl:2 sampler_logprobs" in named


def test_decide_states_which_gain_rule_decided(tmp_path):
    significant = write_synthetic_run(tmp_path / "significant", require_significant_gain=True)
    result = CliRunner().invoke(app, ["decide", str(significant)])
    assert result.exit_code == 0, result.output  # agrees: two eval prompts end tune
    text = " ".join(result.output.split())
    assert ("gain gates (reward, pass_at_group) pass when an anytime-valid one-sided test shows "
            "'gain > minimum' at level 0.025") in text
    # Reward deltas 0.5 and 0.25: two prompts cannot show a gain (test_significant_gain).
    assert ("reward test: gain not shown (raise eval_prompts: the test stays valid when a "
            "re-test is extended); 2 prompts over 1 look(s), mean difference +0.3750") in text
    point = write_synthetic_run(tmp_path / "point", require_significant_gain=False)
    result = CliRunner().invoke(app, ["decide", str(point)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "gain gates (reward, pass_at_group) read the point estimate" in text
    assert "non-default gate require_significant_gain = False (default True)" in text


def test_update_token_counts_are_recounted_from_the_trajectories(run_dir):
    """A step claiming more trained tokens than its kept groups' completions hold, or a padding
    share its own forwarded counts do not give, is named (manifest re-hashed, so only the
    recount can see it)."""
    evidence = json.loads((run_dir / "evidence.json").read_text())
    step = evidence["steps"][1]
    # step 1's synthetic kept group: its completion_tokens sum to the recorded count
    step["tokens"] += 5
    step["padding_fraction"] = 0.0  # recorded 64 forwarded, 40 real: 1 - 40/64 = 0.375
    atomic_write_json(run_dir / "evidence.json", evidence)
    trajectories = read_jsonl(run_dir / "trajectories.jsonl")
    atomic_write_json(run_dir / "manifest.json", build_manifest(evidence, run_dir, trajectories))
    mismatches = {m["field"]: m for m in audit_run(run_dir)["mismatches"]}
    assert mismatches["steps[1].tokens"]["recorded"] == mismatches["steps[1].tokens"]["recomputed"] + 5
    assert mismatches["steps[1].padding_fraction"]["recomputed"] == 0.375


def test_evidence_from_before_the_forwarded_counts_still_decides(run_dir):
    """Runs recorded before tokens_forwarded existed: no such fields anywhere, the audit agrees
    (their `tokens` are still recounted)."""
    evidence = json.loads((run_dir / "evidence.json").read_text())
    for step in evidence["steps"]:
        for key in ("tokens_forwarded", "tokens_forwarded_real", "padding_fraction",
                    "update_tokens_per_second"):
            del step[key]
    for key in ("tokens_forwarded", "tokens_forwarded_real", "padding_fraction",
                "update_tokens_per_second"):
        del evidence["update"][key]
    atomic_write_json(run_dir / "evidence.json", evidence)
    trajectories = read_jsonl(run_dir / "trajectories.jsonl")
    atomic_write_json(run_dir / "manifest.json", build_manifest(evidence, run_dir, trajectories))
    assert audit_run(run_dir)["mismatches"] == []
