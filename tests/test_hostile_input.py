"""A run directory (or any input file) from a stranger is data: one row a hostile case.

Every row runs the real CLI and states the exit code and the text it must print. Refusals are
exit 2 with exactly one line `error: ...` (no traceback); a run directory that reads but does
not hold together is exit 4 with the field named; a string from a file prints as text (rich
markup escaped, control and bidi characters as visible escapes) in every command.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
from synthetic_run import write_synthetic_run
from test_bad_input import Case, replace_line
from test_standalone_eval import A, B
from typer.testing import CliRunner

from grpogate.cli import app
from grpogate.errors import command, plain, visible

ESC = "\x1b"
HOSTILE = f"{ESC}[2J{ESC}]0;TITLE\x07[link=https://x.example]x[/link][green]decision: accept[/oops]"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_synthetic_run(tmp_path_factory.mktemp("pristine"))


@pytest.fixture
def run_dir(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "run"))


def invoke(args: list[str]):
    result = CliRunner().invoke(app, [str(a) for a in args])
    # No traceback, whatever happened: typer's runner keeps an uncaught exception here.
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        repr(result.exception), result.output)
    return result


def one_error_line(result, code: int, fragment: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == code, result.output
    assert result.stdout.strip() == "", result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert fragment in lines[0], lines[0]


def edit_json(path: Path, change) -> None:
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


# --- item 2: every string from a file prints as text ---------------------------------------------

@pytest.mark.parametrize("text, shown", [
    ("[/oops]", "\\[/oops]"),  # rich would raise MarkupError on a closing tag with no opener
    ("[green]decision: accept", "\\[green]decision: accept"),
    (f"{ESC}[2J", "\\x1b[2J"),  # ESC is 0x1b; "[2J" is no markup tag, so no "\\["
    ("a\x07b\x7fc\x9bd", "a\\x07b\\x7fc\\x9bd"),  # BEL (C0), DEL, CSI (C1)
    ("x\u202eevil", "x\\u202eevil"),  # RIGHT-TO-LEFT OVERRIDE
    ("one\ntwo\u2028three", "one\\x0atwo\\u2028three"),  # no second line can be faked
    ("lone \ud800", "lone \\ud800"),  # would crash the console's UTF-8 encoder
    ("café ✓ 日本", "café ✓ 日本"),  # printable text is left alone
])
def test_plain_shows_markup_and_control_characters_as_text(text, shown):
    assert plain(text) == shown


def test_visible_shows_control_characters_and_leaves_markup_for_a_plain_stream():
    # a plain stream (a bench script's stderr) has no markup: "[" stays, ESC and RLO show
    assert visible(f"[green]{ESC}[2J x\u202eevil\nline") == "[green]\\x1b[2J x\\u202eevil\\x0aline"


def test_copyable_commands_are_shell_quoted():
    assert command("grpogate", "decide", "runs/$(id)") == "grpogate decide 'runs/$(id)'"
    assert command("grpogate", "run", "--resume", "a b") == "grpogate run --resume 'a b'"


def forged_status(run_dir: Path) -> None:
    edit_json(run_dir / "evidence.json", lambda e: e.update(status=HOSTILE))


def forged_manifest_key(run_dir: Path) -> None:
    edit_json(run_dir / "manifest.json", lambda m: m.update({HOSTILE: "accept"}))


@pytest.mark.parametrize("forge, field", [
    (forged_status, "evidence.json"),  # the gates table's execution row and a mismatch line
    (forged_manifest_key, "manifest.json: unknown field"),  # a key printed as a field name
])
def test_decide_prints_recorded_strings_as_text(run_dir, forge, field):
    forge(run_dir)
    result = invoke(["decide", run_dir])
    assert result.exit_code == 4, result.output
    assert ESC not in result.output and "\x07" not in result.output
    assert "\\x1b" in result.output and field in result.output
    # The forged "decision: accept" never starts a line; the one decision line is reject.
    decisions = [line for line in result.output.splitlines() if line.startswith("decision:")]
    assert decisions == [decisions[0]] and decisions[0].startswith("decision: reject")


def test_compare_prints_a_recorded_warning_as_text(tmp_path):
    baseline, candidate = A, copy.deepcopy(B)
    candidate["sampling"]["top_p"] = HOSTILE  # A has none: "sampling top_p differs" names it
    for name, document in (("a.json", baseline), ("b.json", candidate)):
        (tmp_path / name).write_text(json.dumps(document))
    result = invoke(["compare", tmp_path / "a.json", tmp_path / "b.json"])
    assert result.exit_code == 0, result.output
    warning = next(line for line in result.output.splitlines() if line.startswith("warning:"))
    # repr() already spelled ESC as \x1b; the markup prints as typed, on the warning's own line.
    assert warning.startswith("warning: sampling top_p differs: None vs '\\x1b[2J")
    assert "[link=https://x.example]x[/link][green]decision: accept[/oops]" in warning
    assert ESC not in result.output


# --- item 5: labels, profiles -------------------------------------------------------------------

@pytest.mark.parametrize("flag, value, fragment", [
    ("--label", "../../x", "config: label '../../x' must be a name"),
    ("--label", "/tmp/absolute", "config: label '/tmp/absolute' must be a name"),
    ("--label", "..", "config: label '..' must be a name"),
    ("--profile", "../../x", "unknown profile '../../x'; known: default"),
    ("--profile", "/etc/passwd", "unknown profile '/etc/passwd'"),
])
def test_labels_are_names_and_profiles_packaged_names(flag, value, fragment, tmp_path,
                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(["run", flag, value, "--dry-run"])
    one_error_line(result, 2, fragment)
    assert list(tmp_path.iterdir()) == []  # nothing written, runs/ included


def test_the_printed_re_check_commands_are_quoted(pristine, tmp_path):
    key = signing_keys(tmp_path)[0]
    run_dir = Path(shutil.copytree(pristine, tmp_path / "$(touch PWNED)"))
    result = invoke(["sign", run_dir, "--key", key])
    assert result.exit_code == 0, result.output
    assert f"`grpogate decide '{run_dir}' --verify-key PUB`" in result.output


# --- item 7: signing ------------------------------------------------------------------------------

def signing_keys(directory: Path) -> tuple[Path, Path, Path, Path]:
    """(EC private, EC public, RSA private, RSA public) PEM files."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    paths = []
    for name, key in (("ec", ec.generate_private_key(ec.SECP256R1())),
                      ("rsa", rsa.generate_private_key(public_exponent=65537, key_size=2048))):
        private, public = directory / f"{name}.pem", directory / f"{name}.pub"
        private.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                              serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
        public.write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        paths += [private, public]
    return tuple(paths)


@pytest.fixture
def signed(run_dir, tmp_path):
    pytest.importorskip("model_signing")
    keys = signing_keys(tmp_path)
    assert invoke(["sign", run_dir, "--key", keys[0]]).exit_code == 0
    return run_dir, keys


def test_an_rsa_key_is_refused_by_sign_and_by_verify(signed):
    run_dir, (_, _, rsa_private, rsa_public) = signed
    one_error_line(invoke(["sign", run_dir, "--key", rsa_private]), 2,
                   "rsa.pem: an RSA key, not an elliptic-curve private key")
    one_error_line(invoke(["decide", run_dir, "--verify-key", rsa_public]), 2,
                   "rsa.pub: an RSA key, not an elliptic-curve public key")


@pytest.mark.parametrize("where", [0, 100, 1000, -10])
def test_a_one_byte_flip_in_run_sig_fails_verification(signed, where):
    run_dir, keys = signed
    signature = bytearray((run_dir / "run.sig").read_bytes())
    signature[where] ^= 0x01
    (run_dir / "run.sig").write_bytes(bytes(signature))
    result = invoke(["decide", run_dir, "--verify-key", keys[1]])
    assert result.exit_code == 4, result.output
    assert "mismatch signature (run.sig does not verify with" in result.output


@pytest.mark.parametrize("added", [".git/config", ".gitattributes", ".github/workflow.yml",
                                   ".gitignore"])
def test_a_git_path_added_after_signing_fails_verification(signed, added):
    run_dir, keys = signed
    (run_dir / added).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / added).write_text("* filter=planted\n")
    result = invoke(["decide", run_dir, "--verify-key", keys[1]])
    assert result.exit_code == 4, result.output
    assert f"Extra files found in model 'run': {added}" in result.output


def test_a_planted_lock_file_fails_verification(signed):
    run_dir, keys = signed
    (run_dir / ".grpogate.lock").write_text("planted")  # the one path the signature leaves out
    result = invoke(["decide", run_dir, "--verify-key", keys[1]])
    assert result.exit_code == 4 and ".grpogate.lock present" in result.output, result.output


# --- items 8 and 9: one bounded JSON reader for every untrusted file ------------------------------

DEEP = "[" * 200_000 + "]" * 200_000


def deep_evidence(run_dir):
    (run_dir / "evidence.json").write_text(DEEP)


def list_evidence(run_dir):
    (run_dir / "evidence.json").write_text("[1, 2]")


def duplicate_decision(run_dir):
    text = (run_dir / "manifest.json").read_text().rstrip()
    assert '"decision": "accept"' in text and text.endswith("}")
    # "accept" first, "reject" last: a first-key and a last-key reader would disagree.
    (run_dir / "manifest.json").write_text(text[:-1].rstrip() + ',\n  "decision": "reject"\n}\n')


def duplicate_in_a_record(run_dir):
    path = run_dir / "trajectories.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = lines[2].rstrip("}") + ', "reward": 1.0}'
    path.write_text("\n".join(lines) + "\n")


def surrogate_question(run_dir):
    path = run_dir / "problems.jsonl"
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    lines[1] = json.dumps(record).replace(json.dumps(record["question"])[1:-1],
                                          "\\ud800 " + json.dumps(record["question"])[1:-1])
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("command_name, forge, fragment", [
    ("decide", deep_evidence, "evidence.json: JSON nested deeper than 64 levels"),
    ("report", deep_evidence, "evidence.json: JSON nested deeper than 64 levels"),
    ("report", list_evidence, "evidence.json: not a JSON object"),
    ("decide", duplicate_decision, "manifest.json: duplicate key 'decision'"),
    ("decide", duplicate_in_a_record, "trajectories.jsonl:3: duplicate key 'reward'"),
    ("decide", surrogate_question,
     'problems.jsonl:2: field "question": a lone surrogate (\\udXXX escape without its pair)'),
])
def test_a_run_directory_json_no_reader_may_take_one_way_is_refused(run_dir, command_name,
                                                                    forge, fragment):
    forge(run_dir)
    one_error_line(invoke([command_name, run_dir]), 2, fragment)


@pytest.mark.parametrize("name, field", [("evidence.json", "claimed_by"),
                                         ("manifest.json", "approved_by")])
def test_an_unknown_top_level_field_is_named(run_dir, name, field):
    edit_json(run_dir / name, lambda d: d.update({field: "the vendor"}))
    result = invoke(["decide", run_dir])
    assert result.exit_code == 4, result.output
    assert f"mismatch {name}: unknown field '{field}': recorded the vendor" in result.output


def test_compare_refuses_deeply_nested_json(tmp_path):
    (tmp_path / "a.json").write_text(DEEP)
    (tmp_path / "b.json").write_text("{}")
    one_error_line(invoke(["compare", tmp_path / "a.json", tmp_path / "b.json"]), 2,
                   "a.json: JSON nested deeper than 64 levels")


@pytest.mark.parametrize("cache, fragment", [
    ("file", "cannot hold the model cache (File exists)"),
    ("/proc/grpogate-cache", "/proc/grpogate-cache: cannot hold the model cache ("),
    ("/sys/grpogate-cache", "/sys/grpogate-cache: cannot hold the model cache ("),
])
def test_a_cache_root_that_cannot_be_a_directory_is_one_error(cache, fragment, tmp_path):
    from grpogate.errors import InputError
    from grpogate.inputs.model_cache import dequantized_cache

    if cache == "file":
        cache = tmp_path / "not-a-directory"
        cache.write_text("")
    with pytest.raises(InputError, match=re.escape(fragment)):
        dequantized_cache(tmp_path / "model.gguf", "0" * 64, Path(cache))


# --- `run` on hostile inputs: exit 2, one line, nothing written ----------------------------------

def run_case(tmp_path, tiny_model_dir, monkeypatch, build, fragment):
    case = Case(tmp_path, tiny_model_dir)
    case.monkeypatch = monkeypatch
    args = build(case)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    one_error_line(invoke(args), 2, fragment)
    assert not case.out.exists() and list((tmp_path / "cwd").iterdir()) == []


def question_line(question_json: str) -> str:
    return '{"question": ' + question_json + ', "answer": "#### 3"}'


RUN_CASES = [
    ("lone surrogate in a question",
     lambda case: replace_line(case, "train.jsonl", 2, question_line('"caf\\ud800 prices?"'))
     or case.args(),
     'train.jsonl:2: field "question": a lone surrogate'),
    ("200k-deep nesting in a problems line",
     lambda case: replace_line(case, "train.jsonl", 3, DEEP) or case.args(),
     "train.jsonl:3: JSON nested deeper than 64 levels"),
    ("200k-deep nesting in a TOML config",
     lambda case: case.args("--config", str(case.file("deep.toml", "x = " + DEEP + "\n"))),
     "deep.toml: not valid TOML: arrays or tables nested deeper than any config"),
    ("a 1 MB question",  # refused on its bytes, before the tokenizer sees it
     lambda case: case.write_lines("train.jsonl", [  # every row: whichever the run draws
         question_line(json.dumps(f"{n} " + "7 " * 499_999)) for n in range(1, 5)]) and case.args(),
     "is 1000000 bytes, over the"),
]


@pytest.mark.parametrize("build, fragment", [c[1:] for c in RUN_CASES], ids=[c[0] for c in RUN_CASES])
def test_run_refuses_hostile_input_in_one_line(build, fragment, tiny_model_dir, tmp_path,
                                               monkeypatch):
    run_case(tmp_path, tiny_model_dir, monkeypatch, build, fragment)


class StubTokenizer:
    """A vocabulary whose longest entry is 6 bytes ("abcdef"); tokenizing fails the test."""

    def get_vocab(self):
        return {"a": 0, "abcdef": 1, "é": 2}

    def apply_chat_template(self, messages, **kwargs):
        raise AssertionError("a question over the byte bound was tokenized")


def test_the_byte_bound_is_checked_before_tokenizing():
    from grpogate.errors import InputError
    from grpogate.inputs.tasks import Problem
    from grpogate.sampling.rollout import encode_prompts

    # 8 tokens x 6 bytes (the longest entry) = 48 bytes: a 49-byte question cannot fit.
    problem = Problem("id", "x" * 49, "1", "train.jsonl:1")
    with pytest.raises(InputError, match="prompt id is 49 bytes, over the 48 bytes that "
                       r"max_prompt_tokens=8 tokens can hold \(x 6 bytes"):
        encode_prompts(StubTokenizer(), [problem], "", 8)
