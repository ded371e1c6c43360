"""`--json` output is strict, ASCII-only JSON: a run directory's strings reach the terminal as
escaped text (no C1 controls, no bidirectional overrides), a non-finite number as null."""

from __future__ import annotations

import json

from synthetic_run import write_synthetic_run
from typer.testing import CliRunner

from grpogate.cli import app
from grpogate.cli.terminal import print_json

HOSTILE = "ok\x9b2J\u202eevil\x1b[31m"  # 8-bit CSI, right-to-left override, 7-bit ESC


def test_print_json_escapes_controls_and_nulls_non_finite_numbers(capsys):
    print_json({"text": HOSTILE, "values": [float("nan"), float("inf"), 1.5], "n": 3})
    out = capsys.readouterr().out
    assert out.isascii() and "\x1b" not in out
    assert "\\u009b2J\\u202eevil\\u001b[31m" in out
    assert json.loads(out) == {"text": HOSTILE, "values": [None, None, 1.5], "n": 3}


def test_decide_json_prints_a_forged_status_as_escaped_text(tmp_path):
    run_dir = write_synthetic_run(tmp_path)
    evidence = json.loads((run_dir / "evidence.json").read_text())
    evidence["status"] = HOSTILE  # the execution check shows the status it read
    (run_dir / "evidence.json").write_text(json.dumps(evidence))
    result = CliRunner().invoke(app, ["decide", str(run_dir), "--json"])
    assert result.exit_code == 4  # the evidence no longer matches its manifest hash
    assert result.output.isascii() and "\\u009b2J" in result.output
    audit = json.loads(result.output)
    execution = next(row for row in audit["checks"] if row["name"] == "execution")
    assert execution["value"] == HOSTILE and execution["passed"] is False
