"""The run report: content, embedded PNGs, no external request, and a headless-Chromium render."""

import base64
import json
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
from synthetic_run import write_synthetic_run
from typer.testing import CliRunner

from grpogate.evidence.audit import audit_run
from grpogate.cli import app
from grpogate.evidence.report import FIGURE_NAMES, SECTIONS, gates_section, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run"]


class Elements(HTMLParser):
    """Every tag's attributes, and the page's visible text."""

    def __init__(self):
        super().__init__()
        self.tags, self.text = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def parse(text):
    parser = Elements()
    parser.feed(text)
    return parser


@pytest.fixture
def run_dir(tmp_path):
    return write_synthetic_run(tmp_path)


def embedded_pngs(page):
    images = [attrs for tag, attrs in page.tags if tag == "img"]
    decoded = []
    for attrs in images:
        prefix = "data:image/png;base64,"
        assert attrs["src"].startswith(prefix), attrs["src"][:40]
        decoded.append(base64.b64decode(attrs["src"][len(prefix):], validate=True))
        assert attrs.get("alt")
    return decoded


def test_report_is_self_contained_and_shows_every_part(run_dir):
    path = write_report(run_dir)
    text = path.read_text()
    page = parse(text)
    pngs = embedded_pngs(page)
    assert len(pngs) == len(FIGURE_NAMES)
    on_disk = {(run_dir / f"report_{name}.png").read_bytes() for name in FIGURE_NAMES}
    assert all(png.startswith(PNG_SIGNATURE) for png in pngs)
    assert set(pngs) == on_disk  # the PNGs beside the report are the embedded ones
    # No external request: no URL, no script, no stylesheet link, no src/href but data: URIs.
    assert "http://" not in text and "https://" not in text
    assert not [tag for tag, _ in page.tags if tag in ("script", "link", "iframe", "object")]
    assert all(value.startswith("data:") for _, attrs in page.tags
               for key, value in attrs.items() if key in ("src", "href"))

    visible = " ".join(page.text)
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert "ACCEPT" in visible
    for check in evidence["decision"]["checks"]:
        assert check["name"] in visible
    assert "10.00 GiB" in visible  # the memory gate, shown in GiB
    for identity in (evidence["inputs"]["baseline_policy_version"],
                     evidence["artifact"]["new_policy_version"],
                     evidence["inputs"]["verifier"]["version"],
                     evidence["inputs"]["train_set"]["sha256"],
                     evidence["inputs"]["eval_set"]["problem_set_sha256"]):
        assert identity in visible
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["files"]["trajectories.jsonl"] in visible
    # Paired statistics: the hand-checked synthetic sign test (2 positive prompts, p = 0.5).
    assert "sign test p = 0.5" in visible and "positive 2, negative 0, ties 0" in visible
    # The report is derived: writing it changes nothing the audit checks.
    assert audit_run(run_dir)["agrees"] is True


def test_report_escapes_text_and_survives_a_run_without_steps(run_dir):
    evidence = json.loads((run_dir / "evidence.json").read_text())
    evidence["run_label"] = "<script>alert(1)</script>"
    evidence["steps"] = []
    evidence["status"] = "no_effective_update"
    (run_dir / "evidence.json").write_text(json.dumps(evidence))
    text = write_report(run_dir).read_text()
    assert "<script>" not in text and "&lt;script&gt;" in text
    assert len(embedded_pngs(parse(text))) == len(FIGURE_NAMES)


@pytest.mark.parametrize("manifest", ['{"files": ["evidence.json"]}', "{not json", None])
def test_report_says_when_the_manifest_cannot_list_the_files(run_dir, manifest):
    """A malformed or missing manifest still gets a report, which says the hashes are absent
    rather than leaving the rows out (a list where the file map belongs crashed it before)."""
    listed = write_report(run_dir).read_text()
    assert "run file evidence.json" in listed and "not listed" not in listed
    if manifest is None:
        (run_dir / "manifest.json").unlink()
    else:
        (run_dir / "manifest.json").write_text(manifest)
    text = write_report(run_dir).read_text()
    assert "run file evidence.json" not in text
    assert "not listed: manifest.json is missing or unreadable" in text


def test_report_cli(run_dir, tmp_path):
    result = CliRunner().invoke(app, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert (run_dir / "report.html").is_file()
    missing = CliRunner().invoke(app, ["report", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "no evidence.json" in missing.output


def test_run_writes_the_report_and_survives_a_plotting_failure(tiny_config, tmp_path,
                                                               monkeypatch):
    import grpogate.evidence.report
    from grpogate.pipeline import NullReporter, run

    evidence = run(tiny_config(tmp_path, out=str(tmp_path / "with-report")))
    assert (tmp_path / "with-report" / "report.html").is_file()

    def broken(run_dir):
        raise RuntimeError("no canvas")

    monkeypatch.setattr(grpogate.evidence.report, "write_report", broken)
    messages = []

    class Recorder(NullReporter):
        def log(self, message):
            messages.append(message)

    evidence = run(tiny_config(tmp_path, out=str(tmp_path / "broken")), Recorder())
    assert (tmp_path / "broken" / "manifest.json").is_file()
    assert not (tmp_path / "broken" / "report.html").exists()
    assert evidence["decision"]["decision"] in ("accept", "tune", "reject")
    assert any("report not written (RuntimeError: no canvas)" in m for m in messages)


def chromium(tmp_path, *arguments):
    return subprocess.run(
        [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}", *arguments],
        capture_output=True, text=True, timeout=120, check=True)


PROBE = """<script>addEventListener('load', () => document.body.setAttribute('data-probe',
JSON.stringify({images: Array.from(document.images, i => [i.complete, i.naturalWidth, i.naturalHeight]),
  sections: Array.from(document.querySelectorAll('h2[id]'), h => h.id),
  fetched: performance.getEntriesByType('resource').map(r => r.name),
  scrollWidth: document.documentElement.scrollWidth, innerWidth: window.innerWidth})));
</script></body>"""


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (as root: "
                    "apt-get update && apt-get install -y chromium)")
def test_report_renders_in_headless_chromium(tmp_path):
    # A run with a failed gate, so the "what to try" section is there too.
    run_dir = write_synthetic_run(tmp_path, minimum_reward_gain=0.9)
    path = write_report(run_dir)
    # 1. The page as Chromium renders it at 1400 px: a screenshot that is not blank.
    shot = tmp_path / "shot.png"
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,3000", path.as_uri())
    from PIL import Image

    with Image.open(shot) as image:
        assert image.size == (1400, 3000)
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 20) or []) > 50
    # 2. A copy of the page with a probe script reports, after the load event: each <img>'s
    # complete flag and natural size (0 x 0 would be a broken image), the sections, every
    # resource the page fetched (none may be outside the page) and its width (no sideways
    # scrolling at 1400 px).
    probe = tmp_path / "probe.html"
    probe.write_text(path.read_text().replace("</body>", PROBE))
    dom = chromium(tmp_path, "--virtual-time-budget=10000", "--window-size=1400,3000",
                   "--dump-dom", probe.as_uri()).stdout
    body = next(attrs for tag, attrs in parse(dom).tags if tag == "body")
    found = json.loads(body["data-probe"])
    assert len(found["images"]) == len(FIGURE_NAMES)
    assert all(complete and width >= 100 and height >= 100
               for complete, width, height in found["images"])
    assert found["sections"] == list(SECTIONS)
    assert [name for name in found["fetched"] if not name.startswith("data:")] == []
    assert found["scrollWidth"] <= found["innerWidth"] == 1400


def test_report_shows_the_configuration_completions_and_what_to_try(tmp_path):
    run_dir = write_synthetic_run(tmp_path, minimum_reward_gain=0.9)  # 0.375 gain: reward fails
    visible = "".join(parse(write_report(run_dir).read_text()).text)
    assert f"grpogate decide {run_dir}" in visible
    config = json.loads((run_dir / "evidence.json").read_text())["config"]
    assert "2 x 2 x 4" in visible  # steps x prompts per step x G of the synthetic run
    assert f"KL coefficient (beta){config['beta']} ({config['kl_estimator']})" in visible
    assert (f"{config['learning_rate']}, {config['lr_scheduler_type']} (warmup_ratio "
            f"{config['warmup_ratio']}), {config['weight_decay']}") in visible
    assert "What to try" in visible and "reward: the re-test mean reward did not gain" in visible
    assert "pass_at_group:" not in visible  # 0.5 >= its gate 0: no advice for a passing gate
    # Real completions with their question and reference: the candidate's best on the first
    # eval prompt reads "So the total is 7." against "#### 7" (synthetic_run.py).
    assert "candidate, best: reward 1" in visible and "So the total is 7." in visible
    assert "Sue bakes 9 cakes and sells 2. How many are left?" in visible
    assert "Where baseline and candidate differ most" in visible
    # Memory on the CPU: one row, not three copies of the resident set.
    assert visible.count("peak resident set") == 1 and "peak allocated" not in visible


def test_the_report_states_the_gain_rule_and_the_smoke_profile_s_purpose(run_dir):
    evidence = json.loads((run_dir / "evidence.json").read_text())
    evidence["config"]["gates"]["require_significant_gain"] = True
    page = gates_section(evidence)
    assert "anytime-valid one-sided test shows" in page
    assert "pipeline check" not in page  # the synthetic profile has no note
    evidence["config"]["profile"] = "smoke"
    evidence["config"]["gates"]["require_significant_gain"] = False
    page = gates_section(evidence)
    assert "<b>profile smoke</b>: a pipeline check" in page
    assert "point estimate" in page and "accepts a candidate whose gain is zero" in page


def test_report_shows_each_steps_update_tokens_and_padding(run_dir):
    text = write_report(run_dir).read_text()
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert "tokens forwarded (with padding)" in text
    # synthetic steps: 64 forwarded, 40 real -> padding share 1 - 40/64 = 0.375; 0.5 s each
    assert "<td>64</td><td>0.375</td><td>0.5</td>" in text
    tokens = evidence["steps"][0]["tokens"]
    assert f"<td>{tokens}</td><td>64</td>" in text and f"<td>{tokens / 0.5:.4g}</td>" in text
