"""The sequential re-test end to end on the tiny model: the looks a run takes, the records it
keeps, and `decide` refusing a re-test edited to stop earlier or later than its rule."""

import json
from pathlib import Path

from grpogate import pipeline
from grpogate.evidence import decisions
from grpogate.evidence.assemble import assemble_evidence, recorded_facts
from grpogate.evidence.audit import audit_run
from grpogate.files import atomic_write_json, read_jsonl, sha256_path

# Eval: 8 prompts in looks of 4; guard: 8 problems x 4 samples a round, at most 2 rounds. The
# tiny random model shows no gain and no non-inferiority, so the rule runs to its maximum.
SEQUENTIAL = ("eval_prompts=8", "eval_batch_prompts=4", "guard.rounds=2",
              "gates.require_significant_gain=true")


def _rehash(run_dir: Path) -> None:
    """Re-pin every file in the manifest, as a forger who edits files would."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    for name in manifest["files"]:
        manifest["files"][name] = sha256_path(run_dir / name)
    atomic_write_json(run_dir / "manifest.json", manifest)


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_run_takes_looks_until_its_maximum_and_decide_agrees(tiny_config, tmp_path):
    evidence = pipeline.run(tiny_config(tmp_path, *SEQUENTIAL))
    run_dir = Path(evidence["run_dir"])
    stored = json.loads((run_dir / "evidence.json").read_text())
    retest = stored["retest"]
    assert [(look["eval_prompts"], look["guard_samples"]) for look in retest["looks"]] == [
        (4, 32), (8, 64)]
    assert (retest["stopped_at_look"], retest["reason"]) == (2, "the maximum re-test is spent")
    # Completions: 2 policies x (8 prompts x eval_group_size 2 + 64 guard samples) = 160.
    assert stored["config"]["eval_group_size"] == 2
    assert retest["completions"] == 2 * (8 * 2 + 64) == 160
    eval_records = read_jsonl(run_dir / "eval_completions.jsonl")
    guard_records = read_jsonl(run_dir / "guard_completions.jsonl")
    assert (len(eval_records), len(guard_records)) == (2 * 8 * 2, 2 * 64)
    # The second guard round samples indexes 4..7 of every problem: no trace id twice.
    assert sorted({r["sample_index"] for r in guard_records}) == list(range(8))
    assert len({r["trace_id"] for r in guard_records}) == len(guard_records)
    rows = {row["name"]: row for row in stored["decision"]["checks"]}
    assert rows["retest_stopping"]["passed"] is True
    assert rows["reward"]["test"]["looks"][-1]["observations"] == 8
    audit = audit_run(run_dir)
    assert audit["mismatches"] == [] and audit["agrees"] is True


def test_an_evidence_edited_to_stop_earlier_is_rejected_naming_the_field(tiny_config, tmp_path):
    run_dir = Path(pipeline.run(tiny_config(tmp_path, *SEQUENTIAL))["run_dir"])
    path = run_dir / "evidence.json"
    evidence = json.loads(path.read_text())
    evidence["retest"]["stopped_at_look"] = 1
    atomic_write_json(path, evidence)
    _rehash(run_dir)
    audit = audit_run(run_dir)
    assert "retest.stopped_at_look" in [m["field"] for m in audit["mismatches"]]
    assert audit["decision"] == "reject"


def test_records_cut_to_an_earlier_look_fail_the_stopping_rule(tiny_config, tmp_path):
    """A forger keeps only the first look's eval prompts (as if the re-test had stopped there)
    and rebuilds a self-consistent evidence with the run's own assembly: every recomputed field
    agrees, but the rule had not stopped at 4 prompts, so `retest_stopping` rejects."""
    run_dir = Path(pipeline.run(tiny_config(tmp_path, *SEQUENTIAL))["run_dir"])
    evidence = json.loads((run_dir / "evidence.json").read_text())
    eval_records = read_jsonl(run_dir / "eval_completions.jsonl")
    first_look = list(dict.fromkeys(r["prompt_id"] for r in eval_records))[:4]
    kept = [r for r in eval_records if r["prompt_id"] in first_look]
    _write_jsonl(run_dir / "eval_completions.jsonl", kept)
    rebuilt = assemble_evidence(recorded_facts(evidence), evidence["config"], evidence["steps"],
                                read_jsonl(run_dir / "trajectories.jsonl"), kept,
                                read_jsonl(run_dir / "guard_completions.jsonl"))
    for key in ("run_dir", "engine"):  # what the run adds after assembly, kept as it was
        if key in evidence:
            rebuilt[key] = evidence[key]
    atomic_write_json(run_dir / "evidence.json", rebuilt)
    _rehash(run_dir)
    row = next(r for r in rebuilt["decision"]["checks"] if r["name"] == "retest_stopping")
    assert row["passed"] is False and "the rule had not stopped" in row["value"]
    audit = audit_run(run_dir)
    failed = [row["name"] for row in audit["checks"] if not row["passed"]]
    assert audit["decision"] == "reject" and "retest_stopping" in failed


def test_the_rule_reads_the_stored_order_not_a_reordered_one(tiny_config, tmp_path):
    """Eval records moved out of the eval set's drawn order name the field: which prompts a
    look held is the set's order, not the file's."""
    run_dir = Path(pipeline.run(tiny_config(tmp_path, *SEQUENTIAL))["run_dir"])
    eval_records = read_jsonl(run_dir / "eval_completions.jsonl")
    _write_jsonl(run_dir / "eval_completions.jsonl", eval_records[::-1])
    _rehash(run_dir)
    fields = [m["field"] for m in audit_run(run_dir)["mismatches"]]
    assert any("the eval set's first, in order" in field for field in fields)


def test_the_point_estimate_rule_takes_one_look(tiny_config, tmp_path):
    evidence = pipeline.run(tiny_config(tmp_path, *SEQUENTIAL[:3],
                                        "gates.require_significant_gain=false"))
    stored = json.loads((Path(evidence["run_dir"]) / "evidence.json").read_text())
    assert [(look["eval_prompts"], look["guard_samples"]) for look in stored["retest"]["looks"]
            ] == [(8, 32)]
    assert "retest_stopping" not in [r["name"] for r in stored["decision"]["checks"]]
    assert decisions.decide_run(stored, stored["config"]["gates"]) == stored["decision"]
