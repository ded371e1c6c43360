"""grpogate sign / decide --verify-key: a signed run verifies with its key, and not after any
change, nor with another key (OpenSSF model-signing, local elliptic-curve keys, offline)."""

from __future__ import annotations

import pytest
from synthetic_run import write_synthetic_run
from typer.testing import CliRunner

from grpogate.cli import app

pytest.importorskip("model_signing")


def key_pair(directory, name):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private = ec.generate_private_key(ec.SECP256R1())
    (directory / f"{name}.pem").write_bytes(private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    (directory / f"{name}.pub").write_bytes(private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return directory / f"{name}.pem", directory / f"{name}.pub"


def test_a_signed_run_verifies_and_any_change_or_other_key_rejects(tmp_path):
    run_dir = write_synthetic_run(tmp_path)
    private, public = key_pair(tmp_path, "producer")
    _, other_public = key_pair(tmp_path, "someone-else")
    runner = CliRunner()
    unsigned = runner.invoke(app, ["decide", str(run_dir), "--verify-key", str(public)])
    assert unsigned.exit_code == 4 and "run.sig missing: the run is not signed" in unsigned.output

    assert runner.invoke(app, ["sign", str(run_dir), "--key", str(private)]).exit_code == 0
    assert (run_dir / "run.sig").is_file()
    verified = runner.invoke(app, ["decide", str(run_dir), "--verify-key", str(public)])
    assert verified.exit_code == 0, verified.output
    assert f"signature: run.sig verifies with {public}" in verified.output

    wrong_key = runner.invoke(app, ["decide", str(run_dir), "--verify-key", str(other_public)])
    assert wrong_key.exit_code == 4 and "does not verify with" in wrong_key.output

    # A file beside the run's own is in no check of the audit; the signature covers it.
    (run_dir / "notes.txt").write_text("added after signing")
    assert runner.invoke(app, ["decide", str(run_dir)]).exit_code == 0
    changed = runner.invoke(app, ["decide", str(run_dir), "--verify-key", str(public)])
    assert changed.exit_code == 4 and "does not verify with" in changed.output


def test_a_run_signed_and_verified_by_a_relative_path_verifies(tmp_path, monkeypatch):
    """The signature leaves out run.sig and the lock file by path; a relative RUN_DIR named
    them relatively, so signing hashed the lock and verifying then missed it."""
    write_synthetic_run(tmp_path)
    private, public = key_pair(tmp_path, "producer")
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    assert runner.invoke(app, ["sign", "run", "--key", str(private)]).exit_code == 0
    verified = runner.invoke(app, ["decide", "run", "--verify-key", str(public)])
    assert verified.exit_code == 0, verified.output
    assert f"signature: run.sig verifies with {public}" in verified.output


def test_signing_an_unfinished_run_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    private, _ = key_pair(tmp_path, "producer")
    result = CliRunner().invoke(app, ["sign", str(tmp_path / "run"), "--key", str(private)])
    assert result.exit_code == 2 and "not a finished run (no manifest.json)" in result.output
