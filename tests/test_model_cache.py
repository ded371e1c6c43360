"""The dequantized model cache vouches for nothing by itself: an entry loads only from an
owner-only directory, with every file hashing as the owner-only record written under this
user's key says; the digest of the files loaded is the identity the evidence records. The
20 s dequantization is replaced by a fake conversion that writes a few bytes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from grpogate.files import cache_dir
from grpogate.inputs import model_cache, policy

CLEAN = bytes(range(256)) * 64
SHA = "ab" * 32


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """Each conversion's directory; the fake conversion writes CLEAN weights and a config."""
    built: list[Path] = []

    def fake_entry(gguf, directory):
        built.append(directory)
        (directory / "model.safetensors").write_bytes(CLEAN)
        (directory / "config.json").write_text("{}")

    monkeypatch.setattr(model_cache, "_write_cache_entry", fake_entry)
    return built


@pytest.fixture
def gguf(tmp_path) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return path


def clean_digest() -> str:
    return model_cache.files_digest({"config.json": hashlib.sha256(b"{}").hexdigest(),
                                     "model.safetensors": hashlib.sha256(CLEAN).hexdigest()})


def test_an_entry_is_converted_once_recorded_and_reused(tmp_path, gguf, conversions):
    entry, loaded = model_cache.dequantized_cache(gguf, SHA, tmp_path / "cache")
    assert len(conversions) == 1 and loaded == clean_digest()
    assert oct(entry.stat().st_mode & 0o777) == "0o700"
    assert oct((entry / model_cache.RECORD).stat().st_mode & 0o777) == "0o600"
    assert model_cache.dequantized_cache(gguf, SHA, tmp_path / "cache") == (entry, loaded)
    assert len(conversions) == 1  # a verified entry is reused


def test_a_corrupted_or_truncated_model_cache_is_noticed_and_rebuilt(tmp_path, gguf, conversions,
                                                                     capsys):
    entry, _ = model_cache.dequantized_cache(gguf, SHA, tmp_path / "cache")
    weights = entry / "model.safetensors"
    data = bytearray(CLEAN)
    data[8000] ^= 0xFF  # one byte inside one block
    weights.write_bytes(bytes(data))
    assert model_cache.dequantized_cache(gguf, SHA, tmp_path / "cache")[0] == entry
    assert len(conversions) == 2 and weights.read_bytes() == CLEAN
    assert "model.safetensors does not match its recorded sha256" in capsys.readouterr().err

    weights.write_bytes(CLEAN[:1000])  # truncated
    model_cache.dequantized_cache(gguf, SHA, tmp_path / "cache")
    assert len(conversions) == 3 and weights.read_bytes() == CLEAN
    assert "rebuilding it" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [entry.name]


def _forge_source_json(entry: Path) -> None:
    """Zero the weights, and rewrite the pins of a source.json beside them, as the round did."""
    weights = entry / "model.safetensors"
    weights.write_bytes(bytes(len(CLEAN)))
    pins = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in entry.iterdir() if p.name != model_cache.RECORD}
    (entry / "source.json").write_text(json.dumps({"sha256": SHA, "files": pins}))


@pytest.mark.parametrize("forgery", ["source.json rewritten", "record rewritten without the key",
                                     "record from another user's key", "a stray file"])
def test_a_forged_entry_is_converted_again(forgery, tmp_path, gguf, conversions, capsys,
                                           monkeypatch):
    entry, _ = model_cache.dequantized_cache(gguf, SHA, tmp_path / "cache")
    record = entry / model_cache.RECORD
    if forgery == "source.json rewritten":
        _forge_source_json(entry)
    elif forgery == "a stray file":  # e.g. an index that would point the loader elsewhere
        (entry / "model.safetensors.index.json").write_text("{}")
    else:
        (entry / "model.safetensors").write_bytes(bytes(len(CLEAN)))
        fields = json.loads(record.read_text())["fields"]
        fields["files"]["model.safetensors"] = hashlib.sha256(bytes(len(CLEAN))).hexdigest()
        if forgery == "record rewritten without the key":
            record.write_text(json.dumps({"fields": fields, "hmac": "0" * 64}))
        else:
            monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "other-user"))
            cache_dir.record_key.cache_clear()
            try:
                cache_dir.write_record(record, fields)
            finally:
                monkeypatch.delenv("XDG_CONFIG_HOME")
                cache_dir.record_key.cache_clear()
    assert model_cache.dequantized_cache(gguf, SHA, tmp_path / "cache") == (entry,
                                                                            clean_digest())
    assert len(conversions) == 2 and (entry / "model.safetensors").read_bytes() == CLEAN
    assert "is not used" in capsys.readouterr().err
    assert sorted(p.name for p in entry.iterdir()) == sorted(
        ["config.json", "model.safetensors", model_cache.RECORD])


@pytest.mark.parametrize("shared", ["world-writable cache", "cache of another user"])
def test_a_cache_others_can_write_is_not_used(shared, tmp_path, gguf, conversions, capsys):
    """The shared cache's entry (forged: zeroed weights, rewritten source.json) is neither
    loaded nor replaced; the GGUF is converted into a private directory for the process."""
    root = tmp_path / "cache"
    entry, _ = model_cache.dequantized_cache(gguf, SHA, root)
    _forge_source_json(entry)
    if shared == "world-writable cache":
        root.chmod(0o777)
    elif os.getuid() == 0:
        os.chown(root, 65534, 65534)
    else:
        pytest.skip("only root can give a directory to another user")
    used, loaded = model_cache.dequantized_cache(gguf, SHA, root)
    assert used != entry and not used.is_relative_to(root) and loaded == clean_digest()
    assert oct(used.stat().st_mode & 0o777) == "0o700"
    assert (used / "model.safetensors").read_bytes() == CLEAN
    assert "the model is not kept there" in capsys.readouterr().err
    assert (entry / "model.safetensors").read_bytes() == bytes(len(CLEAN))  # left as found


def test_the_identity_records_the_files_loaded(tmp_path, gguf, conversions):
    """The evidence's model identity: the GGUF's sha256 (the policy version's base) and the
    digest of the files the weights loaded from, hashed at load."""
    source = policy.resolve_base_model(str(gguf), "", tmp_path / "cache")
    identity = source.identity()
    assert identity["sha256"] == hashlib.sha256(b"GGUF").hexdigest()
    assert identity["loaded_sha256"] == clean_digest()
