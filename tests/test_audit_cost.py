"""What `grpogate decide` may cost is set by the run's recorded config, not by the directory's
writer: implausible counts are refused before anything is built from them, a file holding more
records than the config writes is refused before a line of it is parsed, the step checks are
linear, and the mismatches listed are bounded. Every refusal: exit 2, one `error:` line naming
the file and field, nothing written.

The synthetic run (tests/synthetic_run.py): train_prompts 4, prompts_per_step 2, group_size 4,
eval_prompts 2, eval_group_size 4, no dynamic sampling, guard off. Its limits, by hand:
  steps                  = 4 // 2                = 2
  trajectories.jsonl     = 2 steps x 2 x 4 x 1   = 16 records
  eval_completions.jsonl = 2 policies x 2 x 4    = 16 records
  guard_completions.jsonl = 0 (guard off)
  problems.jsonl         = 4 train + 2 eval + 0  = 6 records
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from synthetic_run import write_synthetic_run
from typer.testing import CliRunner

from grpogate.cli import app
from grpogate.evidence import assemble, audit, audit_files, manifest
from grpogate.evidence.assemble import bootstrap_settings, skipped_comparison
from grpogate.evidence.audit_bounds import MAX_LISTED_MISMATCHES, BoundedAudit, mismatches_found
from grpogate.evidence.audit_files import Audit, numbered_jsonl
from grpogate.files import FileTooLarge, atomic_write_json


@pytest.fixture
def run_dir(tmp_path):
    return write_synthetic_run(tmp_path)


def edit_evidence(run: Path, change) -> None:
    evidence = json.loads((run / "evidence.json").read_text())
    change(evidence)
    atomic_write_json(run / "evidence.json", evidence)


def snapshot(run: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.parent.rglob("*")}


def refused(run: Path) -> str:
    """`decide` on `run`: exit 2, exactly one line `error: ...`, nothing written; the message."""
    before = snapshot(run)
    result = CliRunner().invoke(app, ["decide", str(run)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert result.stdout.strip() == ""
    assert snapshot(run) == before
    return lines[0].removeprefix("error: ")


def counting(monkeypatch, module, name: str) -> list:
    """Replace module.name by a wrapper that records each call's arguments."""
    calls, real = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


# --- implausible counts: refused before one seed per step is built ------------------------------

STEPS = "config.train_prompts // config.prompts_per_step"


@pytest.mark.parametrize("change, message", [
    (lambda e: e["config"].update(train_prompts=10**10),
     "evidence.json: field config.train_prompts: expected a positive integer at most "
     "10,000,000, got 10000000000"),
    # 8,000,000 // 2 = 4,000,000 steps, past MAX_STEPS = 1,000,000
    (lambda e: e["config"].update(train_prompts=8_000_000),
     f"evidence.json: field config.train_prompts: {STEPS} = 4,000,000 steps, more than "
     "1,000,000; not a grpogate run directory"),
    # 6 // 2 = 3 steps, but the evidence records the 2 seeds of its 2 steps
    (lambda e: e["config"].update(train_prompts=6),
     f"evidence.json: field seeds.rollout: 2 seeds, not one per step of the recorded config "
     f"({STEPS} = 3); not a grpogate run directory"),
    (lambda e: e.pop("seeds"),
     f"evidence.json: field seeds.rollout: no list, not one per step of the recorded config "
     f"({STEPS} = 2); not a grpogate run directory"),
    (lambda e: e["config"].update(group_size=10**4000),
     "evidence.json: field config.group_size: expected a positive integer at most 65,536, "
     "got 1000000000000000000000000000000000000..."),
    (lambda e: e["config"].update(eval_group_size=0),
     "evidence.json: field config.eval_group_size: expected a positive integer at most 65,536, "
     "got 0"),
    (lambda e: e["config"].update(dynamic_sampling=True, max_generation_rounds=1001),
     "evidence.json: field config.max_generation_rounds: expected a positive integer at most "
     "1,000, got 1001"),
    (lambda e: e["config"]["guard"].update(prompts=10**8),
     "evidence.json: field config.guard.prompts: expected a positive integer at most "
     "10,000,000, got 100000000"),
], ids=["train_prompts past its cap", "steps past their cap", "a seed per step",
        "no seeds", "a 4001-digit group_size", "eval_group_size 0", "rounds past their cap",
        "guard prompts past their cap"])
def test_implausible_counts_are_refused_before_any_seed_is_built(run_dir, monkeypatch,
                                                                  change, message):
    edit_evidence(run_dir, change)
    seeds = counting(monkeypatch, assemble, "seeds")
    parsed = counting(monkeypatch, audit_files, "parse_json")
    assert refused(run_dir) == message
    assert seeds == []
    assert [where for _, where in parsed] == [str(run_dir / "evidence.json")]  # nothing else


def test_the_comparison_reads_its_seeds_without_a_seed_per_step():
    config = {"seed": 7, "eval_group_size": 4}  # no train_prompts: no step is counted
    assert bootstrap_settings(config)["seed"] == 7
    assert skipped_comparison(config)["eval_seed"] == 7 + 10_000


# --- records past the limit: refused as the file is read, before a line is parsed --------------

@pytest.mark.parametrize("name, extra, count, limit", [
    ("eval_completions.jsonl", "1\n", 17, 16),  # a line that is not an object counts
    ("trajectories.jsonl", "{}\n", 17, 16),
    ("trajectories.jsonl", "{}\r{}\u2028", 18, 16),  # lines as str.splitlines() splits them
    ("problems.jsonl", "{}\n", 7, 6),  # read later, inside the audit's checks
])
def test_one_record_past_the_limit_is_refused_unparsed(run_dir, monkeypatch, name, extra, count,
                                                       limit):
    with (run_dir / name).open("a", encoding="utf-8", newline="") as stream:
        stream.write(extra)
    parsed = counting(monkeypatch, audit_files, "parse_json")
    assert refused(run_dir) == (f"{name}: {count} records, more than a run of the recorded "
                                f"config writes ({limit}); not a grpogate run directory")
    assert str(run_dir / "evidence.json") in [where for _, where in parsed]  # the spy sees reads
    assert not any(where.startswith(str(run_dir / name)) for _, where in parsed)


def test_blank_lines_are_not_records(run_dir):
    with (run_dir / "eval_completions.jsonl").open("a") as stream:
        stream.write(" \n\t\n\n" * 100)  # 16 records still: decided, not refused
    result = CliRunner().invoke(app, ["decide", str(run_dir)])
    assert result.exit_code == 4, result.output  # the file no longer has its recorded hash
    assert "files.eval_completions.jsonl sha256" in result.output


@pytest.mark.parametrize("text", ["", "a\nb", " \n\t\r\n", "{}\r\n{}\r{}\x85{}\u2029 \xa0\n",
                                  "x\x1cy\x1dz\x1e\x1f\u3000", "\x0b\x0c{}\x0b"])
def test_the_record_limit_counts_the_lines_the_reader_reads(tmp_path, text):
    """The limit counts str.splitlines()'s non-blank lines, the ones the reader then parses:
    at the count it passes, one below it refuses before any line is parsed."""
    (tmp_path / "file.jsonl").write_bytes(text.encode())
    records = sum(1 for line in text.splitlines() if line.strip())
    reader = BoundedAudit()
    reader.limit_records(tmp_path, {"file.jsonl": records})
    numbered_jsonl(tmp_path / "file.jsonl", reader)  # within its limit: read
    if records:
        refusing = BoundedAudit()
        refusing.limit_records(tmp_path, {"file.jsonl": records - 1})
        with pytest.raises(FileTooLarge, match=f"{records} records"):
            numbered_jsonl(tmp_path / "file.jsonl", refusing)


# --- the step checks: refused past the config's steps, linear within them -----------------------

def test_more_step_records_than_steps_is_refused_before_any_is_summed(run_dir, monkeypatch):
    edit_evidence(run_dir, lambda e: e.update(steps=[{"step": -1}] * 3))  # 3 > 2 steps
    summed = counting(monkeypatch, audit, "step_summary")
    assert refused(run_dir) == (f"evidence.json: field steps: 3 step records, more than the "
                                f"recorded config runs ({STEPS} = 2); not a grpogate run directory")
    assert summed == []


class Passes(list):
    """A list that counts the passes made over it."""

    passes = 0

    def __iter__(self):
        self.passes += 1
        return super().__iter__()


def test_the_step_checks_pass_over_the_trajectories_once(run_dir, monkeypatch):
    evidence = json.loads((run_dir / "evidence.json").read_text())
    records = [json.loads(line) for line in (run_dir / "trajectories.jsonl").open()]
    summed = counting(monkeypatch, audit, "step_summary")
    trajectories = Passes(records)
    found = Audit()
    audit.check_steps(found, evidence, trajectories, None)
    assert found.mismatches == []
    assert trajectories.passes == 1 and len(summed) == 2  # once over 16 records; 2 steps

    # A step recorded twice is summed once; the second record is named.
    evidence["steps"][1] = dict(evidence["steps"][0])
    summed.clear()
    audit.check_steps(found, evidence, Passes(records), None)
    assert len(summed) == 1
    assert "steps[1] (step 0 recorded twice)" in [
        m["field"] for m in found.mismatches]


# --- the mismatches listed are bounded ----------------------------------------------------------

def test_mismatches_past_the_listed_ones_are_counted_not_kept():
    bounded = BoundedAudit()
    for number in range(MAX_LISTED_MISMATCHES + 5):
        bounded.mismatch(f"line {number}", number, None)
    assert len(bounded.mismatches) == MAX_LISTED_MISMATCHES + 1
    assert bounded.mismatches[MAX_LISTED_MISMATCHES - 1]["field"] == (
        f"line {MAX_LISTED_MISMATCHES - 1}")
    assert bounded.mismatches[-1] == {
        "field": f"more mismatches, not listed (the audit lists the first "
                 f"{MAX_LISTED_MISMATCHES})", "recorded": 5, "recomputed": None, "unlisted": 5}
    # 1000 listed + 5 counted in the last entry = 1005 found, the number the terminal prints.
    assert mismatches_found(bounded.mismatches) == (MAX_LISTED_MISMATCHES + 5,
                                                   MAX_LISTED_MISMATCHES)
    few = BoundedAudit()
    few.mismatch("one")
    assert mismatches_found(few.mismatches) == (1, 1)
    # A replay or a signature appends its mismatches to the list: the count follows the list
    # (it once stayed at an audit's stored figure and printed "0 mismatch(es)").
    assert mismatches_found(few.mismatches + [{"field": "replay", "recorded": 1}]) == (2, 2)


# --- each file is hashed once -------------------------------------------------------------------

def test_a_file_hashed_from_disk_then_parsed_is_hashed_as_parsed(tmp_path):
    """The foreign audit hashes trainer_state.json from disk (the manifest's list) before it
    parses it; the hash it then compares must be of the bytes parsed, so a file swapped between
    the two reads is caught — not the earlier hash of the old file, kept by path."""
    import hashlib

    (tmp_path / "state.json").write_bytes(b'{"a": 1}')
    audit = Audit()
    first = audit.sha256(tmp_path, "state.json")
    (tmp_path / "state.json").write_bytes(b'{"a": 2}')  # swapped after the first read
    parsed = audit.read(tmp_path / "state.json")
    assert first == hashlib.sha256(b'{"a": 1}').hexdigest()
    assert audit.sha256(tmp_path, "state.json") == hashlib.sha256(parsed).hexdigest() != first


def test_one_decide_hashes_each_file_once(run_dir, monkeypatch):
    """The manifest's summary is rebuilt from the files listed, not hashed again, and a file
    named twice (listed, and in manifest.trajectory_identity) is hashed once: from the bytes
    parsed (sha256_bytes) or streamed (sha256_confined), one hash per file the manifest pins.
    (The adapter's tensors digest, its policy version, is another hash, taken apart.)"""
    from_bytes = counting(monkeypatch, audit_files, "sha256_bytes")
    streamed = counting(monkeypatch, audit_files, "sha256_confined")
    rehashed = counting(monkeypatch, manifest, "sha256_path")
    result = CliRunner().invoke(app, ["decide", str(run_dir)])
    assert result.exit_code == 0, result.output
    pinned = json.loads((run_dir / "manifest.json").read_text())["files"]
    assert len(pinned) == 6  # 4 run files (guard off, no trainer log) + the adapter's 2
    assert rehashed == [] and len(from_bytes) + len(streamed) == len(pinned)
    assert {(Path(root) / name).resolve() for root, name, _ in streamed} == {
        (run_dir / name).resolve() for name in (
            "problems.jsonl", "adapter/adapter_config.json", "adapter/adapter_model.safetensors")}
