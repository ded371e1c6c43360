"""What reading a run directory may cost: every file is bounded before it is read.

A forged directory (a synthetic run, then one file changed) must give exit 2 and one line
`error: ...` naming the file, its size and the limit, with no traceback and nothing in the run
directory changed; or, for an adapter file that reads but is not what was recorded, a named
mismatch (exit 4). Big files are sparse (truncate): the test costs no disk. Every limit is
checked with its arithmetic written beside it.
"""

from __future__ import annotations

import hashlib
import json
import struct
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest
from synthetic_run import SYNTHETIC_ADAPTER, safetensors_bytes, write_synthetic_run
from test_hostile_run_dir import edit_json, error_line, grpogate

from grpogate.evidence import audit_files
from grpogate.evidence.audit import audit_run
from grpogate.errors import InputError
from grpogate.files import (FileTooLarge, read_safetensors, safetensors_names,
                            safetensors_sha256)

GiB = 1 << 30
BIG = "9" * 5000  # past Python's 4300-digit limit on converting a decimal integer
TOO_LONG = "an integer of more than 4300 digits; not a number any grpogate file holds"


def listing(run: Path) -> dict[str, tuple[int, int]]:
    """Every path under the run with its size and mtime: what "nothing changed" compares."""
    return {str(path.relative_to(run)): (path.lstat().st_size, path.lstat().st_mtime_ns)
            for path in sorted(run.rglob("*"))}


def refused(run: Path, *args: str) -> str:
    """The one `error:` line of a command that must refuse the run and write nothing."""
    before = listing(run)
    result = grpogate(*args, run, timeout=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout.strip() == "" and error_line(result)
    assert listing(run) == before
    return error_line(result)


@pytest.fixture
def run(tmp_path) -> Path:
    return write_synthetic_run(tmp_path)


def sparse(path: Path, size: int) -> None:
    """`path` (created if missing, its bytes kept) extended to `size` bytes, sparse: no disk."""
    with open(path, "ab") as stream:
        stream.truncate(size)


def prepend_big_integer(path: Path) -> None:
    path.write_text('{"big": ' + BIG + ", " + path.read_text().lstrip()[1:])


# --- an integer Python will not convert ---------------------------------------------------------

@pytest.mark.parametrize("name", ["evidence.json", "manifest.json"])
def test_a_5000_digit_integer_in_a_json_file_is_refused(run, name):
    prepend_big_integer(run / name)
    assert refused(run, "decide") == f"error: {run}/{name}: {TOO_LONG}"


def test_a_5000_digit_integer_in_a_jsonl_line_is_refused_naming_the_line(run):
    path = run / "eval_completions.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = '{"reward": ' + BIG + "}\n"  # replaced, not added: the record count stays
    path.write_text("".join(lines))
    assert refused(run, "decide") == f"error: {run}/eval_completions.jsonl:3: {TOO_LONG}"


def test_a_5000_digit_integer_in_the_weights_header_is_a_named_mismatch(run):
    header = ('{"a": {"dtype": "F32", "shape": [' + BIG + '], "data_offsets": [0, 4]}}').encode()
    weights = run / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    result = grpogate("decide", run, "--json", timeout=60)
    assert result.returncode == 4 and "Traceback" not in result.stderr, result.stderr
    fields = [m["field"] for m in json.loads(result.stdout)["mismatches"]]
    assert (f"artifact (adapter weights unreadable: {weights.resolve()}: malformed safetensors "
            "header (ValueError))") in fields


def test_report_refuses_before_it_writes_anything(run):
    prepend_big_integer(run / "evidence.json")
    assert refused(run, "report") == f"error: {run}/evidence.json: {TOO_LONG}"


# --- files past their size ------------------------------------------------------------------------

def test_a_2_gib_jsonl_file_is_refused_unread(run):
    sparse(run / "trajectories.jsonl", 2 * GiB)
    # 2 GiB = 2,147,483,648 bytes > MAX_FILE_BYTES = 1 GiB = 2**30 = 1,073,741,824.
    assert refused(run, "decide") == (
        f"error: {run}/trajectories.jsonl: 2147483648 bytes, over the limit of 1073741824 for "
        "a run file grpogate parses; not what grpogate writes")


def test_report_refuses_a_2_gib_jsonl_file_before_writing_a_figure(run):
    sparse(run / "eval_completions.jsonl", 2 * GiB)
    assert refused(run, "report") == (
        f"error: {run}/eval_completions.jsonl: 2147483648 bytes, over the limit of 1073741824 "
        "for a run file grpogate parses; not what grpogate writes")


def test_more_line_breaks_than_a_real_jsonl_file_holds_are_refused_before_a_split(run):
    with open(run / "trajectories.jsonl", "a") as stream:
        stream.write("\n" * (2**22 + 1))
    # 16 records (2 steps x 2 prompts x G=4), one "\n" each, + 4,194,305 blank lines
    # = 4,194,321 > MAX_JSONL_LINES = 2**22 = 4,194,304.
    assert refused(run, "decide") == (
        f"error: {run}/trajectories.jsonl: 4194321 line breaks, over the limit of 4194304 for a "
        "JSONL file; not what grpogate writes")


def test_the_files_an_audit_parses_are_bounded_together(run, monkeypatch):
    sizes = {name: (run / name).stat().st_size
             for name in ("evidence.json", "manifest.json", "trajectories.jsonl")}
    # Read in this order (guard off); a limit one byte short of the three refuses the third.
    limit = sum(sizes.values()) - 1
    monkeypatch.setattr(audit_files, "MAX_FILE_BYTES", limit)
    with pytest.raises(FileTooLarge) as refusal:
        audit_run(run)
    assert str(refusal.value) == (
        f"{run}/trajectories.jsonl: {limit + 1} bytes with those read before, over the limit of "
        f"{limit} for the files an audit parses; not what grpogate writes")


def test_weights_longer_than_their_header_declares_are_refused_unhashed(run):
    original = safetensors_bytes(SYNTHETIC_ADAPTER)
    header = int.from_bytes(original[:8], "little")
    # 2 tensors x 2 float32 values x 4 bytes = 16 tensor bytes after the 8 + header bytes.
    assert len(original) == 8 + header + 16
    weights = run / "adapter" / "adapter_model.safetensors"
    sparse(weights, 2 * GiB)
    assert refused(run, "decide") == (
        f"error: {weights.resolve()}: 2147483648 bytes, over the limit of {len(original)} for "
        f"this safetensors file (8 + {header} header + 16 tensor bytes, as its header "
        "declares); not what grpogate writes")


def write_weights(path: Path, tensors: dict[str, tuple[int, int]], tensor_bytes: int = 0) -> int:
    """A U8 safetensors file declaring `tensors` {name: (begin, end)}, then `tensor_bytes`
    sparse zero bytes; returns its header's length."""
    header = json.dumps({name: {"dtype": "U8", "shape": [end - begin], "data_offsets": [begin, end]}
                         for name, (begin, end) in tensors.items()}).encode()
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(header)) + header)
        stream.truncate(8 + len(header) + tensor_bytes)
    return len(header)


def test_a_header_declaring_more_tensor_bytes_than_the_cap_is_refused(run):
    weights = run / "adapter" / "adapter_model.safetensors"
    # One tensor of 4 GiB + 1 = 4,294,967,297 bytes > MAX_SAFETENSORS_DATA = 4 GiB: refused from
    # the header alone (the file holds no tensor byte).
    write_weights(weights, {"a": (0, 4 * GiB + 1)})
    assert refused(run, "decide") == (
        f"error: {weights.resolve()}: tensor 'a' (U8, 1 dims) holds over 4294967296 bytes, the "
        "limit of the tensors of a safetensors file; not what grpogate writes")
    # Two of 2 GiB + 1 each, packed, in a (sparse) file of exactly 8 + header + their bytes:
    # each within the cap, together 4,294,967,298 > 4,294,967,296.
    write_weights(weights, {"a": (0, 2 * GiB + 1), "b": (2 * GiB + 1, 4 * GiB + 2)}, 4 * GiB + 2)
    assert refused(run, "decide") == (
        f"error: {weights.resolve()}: 4294967298 bytes, over the limit of 4294967296 for the "
        "tensors of a safetensors file; not what grpogate writes")


def test_the_files_an_audit_hashes_are_bounded_together(run):
    for index in range(7):
        sparse(run / "adapter" / f"extra{index}.bin", GiB - 1)  # each within 1 GiB
    total = sum(path.stat().st_size for path in run.rglob("*")
                if path.is_file() and path.name != "manifest.json")
    # MAX_HASHED_BYTES = MAX_SAFETENSORS_BYTES + 2 x MAX_FILE_BYTES
    #   = (8 + 100 MiB header + 4 GiB) + 2 GiB = 8 + 104,857,600 + 4,294,967,296 + 2,147,483,648
    #   = 6,547,308,552 < 7 x (2**30 - 1) = 7,516,192,761 <= total.
    assert total > 6_547_308_552
    assert refused(run, "decide") == (
        f"error: {run}: {total} bytes, over the limit of 6547308552 for the files an audit "
        "hashes in all; not what grpogate writes")


# --- the manifest's names ------------------------------------------------------------------------

def test_a_manifest_listing_more_names_than_a_run_writes_is_refused(run):
    def aliases(manifest):
        listed = len(manifest["files"])
        assert listed == 6  # 4 run files (no guard, no trainer log) + the adapter's 2 files
        for count in range(1, 1001 - listed + 1):  # 1001 - 6 = 995 aliases: 1001 > 1000
            manifest["files"]["adapter/" + "./" * count + "adapter_model.safetensors"] = "0" * 64
    edit_json(run / "manifest.json", aliases)
    assert refused(run, "decide") == (
        f"error: {run}/manifest.json: field files: 1001 entries, more than the 1000 a run's "
        "manifest may list; not a grpogate run directory")


def test_names_not_in_normal_form_are_flagged_unread_and_a_file_is_hashed_once(run, monkeypatch):
    weights = "adapter/adapter_model.safetensors"
    (run / "adapter" / "alias.safetensors").symlink_to("adapter_model.safetensors")
    odd = ["adapter/./adapter_model.safetensors", "adapter//adapter_model.safetensors",
           "./evidence.json", "adapter/../adapter/adapter_model.safetensors", "/etc/passwd",
           "adapter/adapter_model.safetensors\0"]

    def add(manifest):
        manifest["files"]["adapter/alias.safetensors"] = manifest["files"][weights]
        manifest["files"].update({name: "0" * 64 for name in odd})
    edit_json(run / "manifest.json", add)
    hashed = Counter()
    real = audit_files.sha256_confined

    def counted(root, name, *rest):
        hashed[(Path(root) / name).resolve()] += 1
        return real(root, name, *rest)
    monkeypatch.setattr(audit_files, "sha256_confined", counted)
    audit = audit_run(run)
    assert [m["field"] for m in audit["mismatches"]] == [
        f"files.{name} (not a relative path in normal form; not read)" for name in odd]
    # The files not parsed before the hashes (problems.jsonl is parsed after), each once: the
    # weights for both their names and artifact.sha256.
    assert hashed == {(run / name).resolve(): 1 for name in (
        "problems.jsonl", "adapter/adapter_config.json", weights)}


# --- the baseline adapter outside the run ---------------------------------------------------------

def name_baseline(run: Path, folder: Path) -> None:
    edit_json(run / "evidence.json", lambda e: e["inputs"].update(
        baseline_adapter={"path": str(folder), "sha256": "0"}))


def test_a_baseline_adapter_outside_the_run_is_read_under_the_same_bounds(run, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    weights = outside / "adapter_model.safetensors"
    weights.write_bytes(safetensors_bytes(SYNTHETIC_ADAPTER))
    declared = weights.stat().st_size
    sparse(weights, 2 * GiB)  # 2 GiB, its header declaring `declared` bytes
    name_baseline(run, outside)
    assert refused(run, "decide").startswith(
        f"error: {weights}: 2147483648 bytes, over the limit of {declared} for this safetensors "
        "file (8 + ")
    write_weights(weights, {"a": (0, 4 * GiB + 1)})  # 4 GiB + 1 > 4 GiB, from the header alone
    assert refused(run, "decide") == (
        f"error: {weights}: tensor 'a' (U8, 1 dims) holds over 4294967296 bytes, the limit of "
        "the tensors of a safetensors file; not what grpogate writes")


def test_an_unreadable_baseline_adapter_outside_the_run_is_a_mismatch_read_8_bytes(run, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    sparse(outside / "adapter_model.safetensors", 2 * GiB)  # zeros: a header of 0 bytes
    name_baseline(run, outside)
    result = grpogate("decide", run, "--json", timeout=60)
    assert result.returncode == 4 and "Traceback" not in result.stderr, result.stderr
    assert (f"inputs.baseline_adapter (unreadable: {outside}/adapter_model.safetensors: malformed "
            "safetensors header (JSONDecodeError))") in [
        m["field"] for m in json.loads(result.stdout)["mismatches"]]


# --- what still reads -----------------------------------------------------------------------------

def test_the_streamed_weights_hash_is_the_adapter_identity_rule(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(safetensors_bytes(SYNTHETIC_ADAPTER))
    digest = hashlib.sha256()  # the rule written out: sorted by name, "name|dtype|shape\n" + bytes
    for name in sorted(SYNTHETIC_ADAPTER):
        digest.update(f"{name}|torch.float32|(2,)\n".encode())
        digest.update(struct.pack("<2f", *SYNTHETIC_ADAPTER[name]))
    assert safetensors_sha256(path) == digest.hexdigest()
    assert {name: bytes(data) for name, (_, _, data) in read_safetensors(path).items()} == {
        name: struct.pack("<2f", *values) for name, values in SYNTHETIC_ADAPTER.items()}


def test_tensor_names_are_read_from_the_header_alone(tmp_path):
    path = tmp_path / "w.safetensors"
    write_weights(path, {"a": (0, GiB), "b": (GiB, 2 * GiB)}, 2 * GiB)  # 2 GiB of sparse tensors
    tracemalloc.start()
    try:
        names = safetensors_names(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert names == {"a", "b"} and peak < 1 << 20  # the header's bytes, not the 2 GiB after it
    path.write_bytes(safetensors_bytes(SYNTHETIC_ADAPTER))
    assert safetensors_names(path) == set(read_safetensors(path))


def test_a_weights_path_that_cannot_be_opened_is_bad_input_not_a_traceback(tmp_path):
    """A baseline path the run directory names may vanish or be unreadable after its check."""
    with pytest.raises(InputError, match="unreadable"):
        safetensors_sha256(tmp_path / "gone" / "adapter_model.safetensors")
