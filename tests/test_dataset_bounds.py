"""A stranger's table is bounded and confined before Hugging Face datasets reads it.

Each hostile table is loaded in a fresh interpreter under a 1 GiB address-space cap and a
timeout, with HF_HOME, HF_DATASETS_CACHE and TMPDIR pointed at empty folders: the load is
exit 2 with one `error:` line naming the file, line or row and field (and for a bound the
config key that raises it), no traceback, and both folders are empty afterwards (no Arrow
files or locks left in a datasets cache, no staged copy left behind)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

SRC = Path(__file__).resolve().parents[1] / "src"
CAP = 1 << 30
TIB = 1 << 40
# How main printed /etc/passwd's first 4 bytes: as an integer ("Expected to read 1953460082
# metadata bytes") or as text.
PASSWD_BYTES = {"1953460082", "root:x:0:0:root:/root:/bin/bash", "(1953460082"}
LOAD = """
import sys
from grpogate.config import load_config
from grpogate.errors import InputError
from grpogate.inputs import tasks, training_prompts
kind, path, *sets = sys.argv[1:]
config = load_config("smoke", task={"source": "dataset", "path": path}, overrides=sets)
try:
    if kind == "task":
        train, _, eval_set, identity = tasks.load_problem_sets(config.task, 8, 4)
        print("ok", len(train), len(eval_set), " ".join(identity["files"]))
    else:
        train, identity, _, _ = training_prompts.training_problems(config, path, False,
                                                                   lambda m, w: "")
        print("ok", len(train))
except InputError as error:
    print(f"error: {error}")
    sys.exit(2)
"""


def rows(count: int = 40, shift: int = 0) -> list[dict]:
    return [{"prompt": f"What is {i} + {i + shift}?", "answer": 2 * i + shift}
            for i in range(count)]


def jsonl_bytes(items: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in items).encode()


def saved(folder: Path, items: list[dict]) -> Path:
    datasets.Dataset.from_list(items).save_to_disk(str(folder))
    return folder


def load(tmp_path: Path, path, *sets: str, kind: str = "task", timeout: int = 60,
         cwd: Path | None = None) -> tuple[int, str, float]:
    """(exit code, its one output line, seconds) of loading `path` in a capped child; the
    child's datasets cache and temporary folder must be empty afterwards."""
    cache, temporary = tmp_path / "hf-home", tmp_path / "tmpdir"
    cache.mkdir(exist_ok=True)
    temporary.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HOME": str(cache),
           "HF_DATASETS_CACHE": str(cache / "datasets"), "TMPDIR": str(temporary),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", LOAD, kind, str(path), *sets], capture_output=True, text=True,
        timeout=timeout, env=env, cwd=cwd or tmp_path,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP)))
    seconds = time.monotonic() - start
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines[-5:]
    assert list(cache.rglob("*")) == [] and list(temporary.iterdir()) == [], (
        list(cache.rglob("*"))[:5], list(temporary.iterdir()))
    return result.returncode, lines[0], seconds


def refused(tmp_path, path, *fragments: str, sets=(), kind="task", within=30.0, cwd=None):
    code, line, seconds = load(tmp_path, path, *sets, kind=kind, cwd=cwd)
    assert code == 2 and line.startswith("error: "), line
    for fragment in fragments:
        assert fragment in line, line
    assert seconds < within, (seconds, line)
    return line


# --- issue 60: the reader's own words --------------------------------------------------------

@pytest.mark.parametrize("kind", ["task", "train"])
def test_a_latin1_byte_names_its_line_and_byte(tmp_path, kind):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(jsonl_bytes(rows()[:5]) + b'{"prompt": "caf\xe9?", "answer": 2}\n'
                     + jsonl_bytes(rows()[6:]))
    refused(tmp_path, path, f"{path}:6: not UTF-8 text (byte 0xe9 at column 16)", kind=kind)


@pytest.mark.parametrize("kind", ["task", "train"])
def test_a_jsonl_cut_off_at_row_18_names_line_18(tmp_path, kind):
    lines = jsonl_bytes(rows()).decode().splitlines(True)
    path = tmp_path / "cut.jsonl"
    path.write_text("".join(lines[:17]) + lines[17][:20])
    refused(tmp_path, path, f"{path}:18: not valid JSON (Unterminated string starting at "
                            "column 12)", kind=kind)


def test_a_train_data_fifo_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "train.jsonl")
    refused(tmp_path, tmp_path / "train.jsonl", "train.jsonl: not a regular file", kind="train",
            within=10)


@pytest.mark.parametrize("name, text", [("empty.jsonl", ""), ("header.csv", "prompt,answer\n"),
                                        ("blank.jsonl", "\n \n")])
def test_an_empty_table_says_no_rows(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    refused(tmp_path, tmp_path / name, f"{tmp_path / name}: no rows")


def test_mixed_encodings_in_a_csv_name_the_first_latin1_line(tmp_path):
    path = tmp_path / "mixed.csv"
    path.write_bytes(b"prompt,answer\n" + "".join(f"Is {i} \u00e9?,{i}\n" for i in range(20)
                                                  ).encode("utf-8")
                     + "".join(f"Is {i} \u00e9?,{i}\n" for i in range(20, 40)).encode("latin-1"))
    refused(tmp_path, path, f"{path}:22: not UTF-8 text (byte 0xe9 at column 7)")


def test_content_given_as_a_list_of_parts_names_row_and_field(tmp_path):
    path = tmp_path / "parts.jsonl"
    path.write_bytes(jsonl_bytes([{"prompt": [{"role": "user", "content": [
        {"type": "text", "text": row["prompt"]}]}], "answer": row["answer"]} for row in rows()]))
    refused(tmp_path, path, f'{path}: row 1: field "prompt": the user message\'s content is a '
                            "list of parts")


# --- issue 61: bounds before datasets builds anything ----------------------------------------

@pytest.fixture(scope="module")
def ten_million_rows(tmp_path_factory) -> Path:
    """10,000,000 valid rows in a small parquet (one prompt, dictionary-encoded)."""
    import numpy as np

    count = 10_000_000
    prompt = pa.DictionaryArray.from_arrays(np.zeros(count, np.int32), ["What is 1 + 1?"])
    path = tmp_path_factory.mktemp("big") / "big.parquet"
    pq.write_table(pa.table({"prompt": prompt, "answer": np.full(count, 2)}), path)
    return path


@pytest.mark.parametrize("kind", ["task", "train"])
def test_ten_million_rows_are_refused_from_the_footer(tmp_path, ten_million_rows, kind):
    refused(tmp_path, ten_million_rows, "more than 200000 rows, over the limit "
            "task.max_table_rows = 200000; a larger table is read with --set "
            "task.max_table_rows=N", kind=kind, within=15)


def test_a_sparse_terabyte_csv_is_refused_unread(tmp_path):
    path = tmp_path / "t.csv"
    with open(path, "wb") as stream:
        stream.write(b"prompt,answer\n")
        os.truncate(stream.fileno(), TIB)
    refused(tmp_path, path, f"{path}: {TIB} bytes", "task.max_table_bytes = 536870912")


@pytest.mark.parametrize("kind", ["task", "train"])
def test_a_sparse_terabyte_beside_a_saved_folder_is_never_read(tmp_path, kind):
    folder = saved(tmp_path / "saved", rows())
    with open(folder / "junk.bin", "wb") as stream:
        os.truncate(stream.fileno(), TIB)
    code, line, seconds = load(tmp_path, folder, kind=kind)
    assert code == 0 and seconds < 30, line
    if kind == "task":
        assert line == "ok 8 4 data-00000-of-00001.arrow dataset_info.json state.json"


def test_a_fifo_as_a_saved_folders_data_file_is_refused_not_waited_on(tmp_path):
    folder = saved(tmp_path / "saved", rows())
    (folder / "data-00000-of-00001.arrow").unlink()
    os.mkfifo(folder / "data-00000-of-00001.arrow")
    refused(tmp_path, folder, f"{folder}/data-00000-of-00001.arrow: not a regular file")


def test_a_fifo_named_without_a_suffix_is_a_local_name_not_a_hub_id(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    line = refused(tmp_path, "fifo", "fifo: not a table datasets reads here", within=10)
    assert "Hub" not in line


@pytest.mark.parametrize("named", ["../outside/x.arrow", "/etc/passwd", "sub/x.arrow", ".."])
def test_state_json_may_name_only_a_data_file_inside_its_folder(tmp_path, named):
    folder = saved(tmp_path / "saved", rows())
    (tmp_path / "outside").mkdir()
    os.replace(folder / "data-00000-of-00001.arrow", tmp_path / "outside" / "x.arrow")
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] = [{"filename": named}]
    (folder / "state.json").write_text(json.dumps(state))
    line = refused(tmp_path, folder, f'{folder}/state.json: field "_data_files": a data file '
                                     f"{named!r} is not a plain name inside the dataset folder")
    assert PASSWD_BYTES.isdisjoint(line.split()), line


@pytest.mark.parametrize("target", ["/etc/passwd", "../outside/x.arrow"])
def test_a_data_file_linked_out_of_the_folder_is_refused_and_never_printed(tmp_path, target):
    folder = saved(tmp_path / "saved", rows())
    (tmp_path / "outside").mkdir()
    os.replace(folder / "data-00000-of-00001.arrow", tmp_path / "outside" / "x.arrow")
    (folder / "data-00000-of-00001.arrow").symlink_to(target)
    line = refused(tmp_path, folder, f"{folder}/data-00000-of-00001.arrow: escapes the dataset "
                                     "folder")
    assert PASSWD_BYTES.isdisjoint(line.split()), line


def test_a_jsonl_line_nested_100000_deep_is_refused_before_pyarrow(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_bytes(jsonl_bytes(rows(1)) + b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000
                     + b', "answer": 1}\n')
    refused(tmp_path, path, f"{path}:2: nested deeper than 32, over the limit "
                            "task.max_nesting_depth = 32")


def test_a_deep_json_document_and_a_deep_parquet_column_are_refused(tmp_path):
    document = tmp_path / "deep.json"
    document.write_text('[{"prompt": ' + "[" * 40 + "]" * 40 + ', "answer": 1}]')
    refused(tmp_path, document, f"{document}: nested deeper than 32")
    nested = pa.array([[[[[1]]]]] * 40)
    table = tmp_path / "deep.parquet"
    pq.write_table(pa.table({"prompt": [r["prompt"] for r in rows()], "answer": nested}), table)
    refused(tmp_path, table, f'{table}: field "answer": nested deeper than 3', sets=[
        "task.max_nesting_depth=3"])


def test_a_too_long_cell_names_line_or_row_and_field(tmp_path):
    long_row = {"prompt": "x" * 5000, "answer": 1}
    path = tmp_path / "long.jsonl"
    path.write_bytes(jsonl_bytes(rows(3) + [long_row]))
    limit = ["task.max_cell_chars=1000"]
    refused(tmp_path, path, f'{path}:4: field "prompt": a string of 5000 characters, over the '
                            "limit task.max_cell_chars = 1000", sets=limit)
    table = tmp_path / "long.parquet"
    pq.write_table(pa.Table.from_pylist(rows(3) + [long_row]), table)
    refused(tmp_path, table, f'{table}: row 4: field "prompt": a value of 5000 bytes', sets=limit)
    csv_file = tmp_path / "long.csv"
    csv_file.write_text("prompt,answer\nWhat is 1 + 1?,2\n" + "x" * 5000 + ",1\n")
    refused(tmp_path, csv_file, f"{csv_file}:3: a cell longer than 1000 characters", sets=limit)


def test_a_400_mb_line_is_refused_by_the_line_bound(tmp_path):
    """A line past 4 bytes a character of the longest cell is refused before it is decoded."""
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as stream:
        stream.write(jsonl_bytes(rows(3)) + b'{"prompt": "')
        stream.truncate(400_000_000)  # sparse: zeros inside the string, no newline
    refused(tmp_path, path, f"{path}:4: a line longer than 4259840 bytes",
            "task.max_cell_chars")


def test_a_state_json_naming_too_many_files_and_a_huge_metadata_file_are_refused(tmp_path):
    folder = saved(tmp_path / "many", rows())
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] = [{"filename": f"d{i}.arrow"} for i in range(5000)]
    (folder / "state.json").write_text(json.dumps(state))
    refused(tmp_path, folder, 'field "_data_files": expected a list of 1 to 4096 data files')
    big = saved(tmp_path / "big", rows())
    with open(big / "dataset_info.json", "r+b") as stream:
        os.truncate(stream.fileno(), TIB)
    refused(tmp_path, big, f"{big}/dataset_info.json: {TIB} bytes, over the 1048576 a "
                           "datasets metadata file holds")


def test_a_split_name_leaving_the_folder_is_refused(tmp_path):
    folder = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows()),
                          "test": datasets.Dataset.from_list(rows(40, 1))}
                         ).save_to_disk(str(folder))
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "../escape"]}))
    refused(tmp_path, folder, f'{folder}/dataset_dict.json: field "splits": a split '
                              "'../escape' is not a plain name")


# --- one normalization for identity and isolation --------------------------------------------

def test_eval_rows_differing_by_one_control_character_overlap_the_train_rows(tmp_path):
    """Every eval row is a train row with "\x01" appended: all 4 drawn eval prompts are train
    prompts (8 train rows, all drawn)."""
    folder = tmp_path / "dict"
    train = rows(8)
    tagged = [{"prompt": row["prompt"] + "\x01", "answer": row["answer"]} for row in train]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(tagged)}).save_to_disk(str(folder))
    refused(tmp_path, folder, "error: train and eval sets share 4 prompt(s)")


def test_decide_rehashes_exactly_the_files_the_table_was_read_from(tmp_path):
    """The identity covers the files state.json names and the metadata, nothing beside them;
    a changed data file is a mismatch, a file added beside them is not."""
    from grpogate.evidence.audit_files import Audit
    from grpogate.evidence.table_audit import check_table_identity
    from grpogate.inputs.dataset_task import read_splits

    folder = saved(tmp_path / "saved", rows())
    _, identity = read_splits(str(folder))
    assert identity["files"] == ["data-00000-of-00001.arrow", "dataset_info.json", "state.json"]
    evidence = {"config": {"task": {"source": "dataset"}},
                "inputs": {"train_set": {"kind": "dataset", **identity},
                           "eval_set": {"kind": "dataset", **identity}}}

    def mismatches() -> list[str]:
        audit = Audit()
        check_table_identity(audit, evidence)
        return [m["field"] for m in audit.mismatches]

    assert mismatches() == []
    (folder / "beside.txt").write_text("not read")
    assert mismatches() == []
    data = folder / "data-00000-of-00001.arrow"
    original = data.read_bytes()
    data.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    assert mismatches() == [f"inputs.train_set.sha256 (the table {folder}, re-hashed)"]
    data.unlink()
    data.symlink_to("/etc/passwd")
    audit = Audit()
    check_table_identity(audit, evidence)
    assert "escapes the dataset folder" in audit.mismatches[0]["recomputed"]


def test_prompt_ids_and_the_isolation_rule_fold_the_same_characters():
    from grpogate.inputs.isolation import normalized as isolation_normalized
    from grpogate.inputs.problem import normalized, prompt_id

    assert isolation_normalized is normalized
    plain = "What is 2 + 3?"
    for variant in ("What is 2 + 3?\x01", "What\u200b is 2 + 3?", "WHAT  is 2 +\t3?",
                    "\x7fWhat is \uff12 + 3?"):
        assert prompt_id(variant) == prompt_id(plain), repr(variant)
    # sha256("what is 2 + 3?")[:16], computed by hand with hashlib in a shell
    import hashlib
    assert prompt_id(plain) == hashlib.sha256(b"what is 2 + 3?").hexdigest()[:16]
    assert prompt_id("What is 2 + 3 ?") != prompt_id(plain)  # a space inside a word run stays


@pytest.mark.parametrize("name, content, expected", [
    ("latin1.jsonl", jsonl_bytes(rows()[:5]) + b'{"prompt": "caf\xe9?", "answer": 2}\n',
     ":6: not UTF-8 text"),
    ("cut.jsonl", jsonl_bytes(rows())[:-30], ":40: not valid JSON"),
    ("empty.jsonl", b"", ": no rows")])
def test_the_run_command_says_it_in_one_line_and_leaves_no_cache(tmp_path, tiny_model_dir, name,
                                                                 content, expected):
    """Issue 60's three files through `grpogate run --dry-run` itself: exit 2, one error line
    naming the file and line, no traceback, nothing in HF_HOME, nothing written."""
    path = tmp_path / name
    path.write_bytes(content)
    cache, out = tmp_path / "hf-home", tmp_path / "run"
    cache.mkdir()
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HOME": str(cache), "COLUMNS": "200",
           "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "grpogate", "run", "--profile", "smoke", "--model",
         str(tiny_model_dir), "--task", f"dataset:{path}", "--dry-run", "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=env,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (4 * CAP, 4 * CAP)))
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2 and "Traceback" not in result.stderr, lines[-5:]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}{expected}"), lines
    assert list(cache.rglob("*")) == [] and not out.exists()


def test_train_data_records_the_hash_of_the_bytes_read_and_decide_rehashes_it(tmp_path):
    """gate --train-data: the identity holds sha256(sha256(name + bytes)) of the JSONL read
    (computed here with hashlib), and the audit re-hashes it: a changed file is a mismatch."""
    import hashlib

    from grpogate.config import load_config
    from grpogate.evidence.audit_files import Audit
    from grpogate.evidence.table_audit import check_table_identity
    from grpogate.inputs.training_prompts import training_problems

    path = tmp_path / "train.jsonl"
    path.write_bytes(jsonl_bytes(rows(5)))
    _, identity, _, _ = training_problems(load_config("smoke"), str(path), False,
                                          lambda m, w: "")
    inner = hashlib.sha256(b"train.jsonl" + path.read_bytes()).digest()
    assert identity["sha256"] == hashlib.sha256(inner).hexdigest()
    assert identity["files"] == ["train.jsonl"]
    evidence = {"config": {"task": {"source": "reasoning-gym"}},
                "inputs": {"train_set": identity}}
    audit = Audit()
    check_table_identity(audit, evidence)
    assert audit.mismatches == []
    path.write_bytes(jsonl_bytes(rows(6)))
    check_table_identity(audit, evidence)
    assert [m["field"] for m in audit.mismatches] == [
        f"inputs.train_set.sha256 (the table {path}, re-hashed)"]
