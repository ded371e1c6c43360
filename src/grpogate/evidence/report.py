"""The run report: one self-contained HTML file (images embedded as data URIs) and its PNGs.

`write_report(run_dir)` reads only the stored evidence (and the manifest's file hashes), so a
report can be regenerated for any finished run. It shows the decision and every gate, the stage
time breakdown, reward / valid-group ratio / KL per update step, the baseline and candidate
length histograms, a per-prompt paired plot, the bootstrap intervals with their exact tests,
and the input identities. The page makes no external request: no scripts, no fonts, no links;
every image is a PNG inlined as base64 (and also written beside it as report_*.png).

Plots use matplotlib's object API with the Agg canvas (no pyplot global state, no display).
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any, Callable

from grpogate.errors import InputError
from grpogate.files import atomic_write_bytes

REPORT_HTML = "report.html"
BASELINE_COLOR, CANDIDATE_COLOR = "#7f7f7f", "#1f77b4"
STAGES = ("load", "rollout", "verification", "update", "evaluation")
_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:70em;color:#222}
h1{margin-bottom:.2em} h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0} td,th{border:1px solid #ccc;padding:.25em .6em;
text-align:left;vertical-align:top} th{background:#f3f3f3} code{font-size:.9em;word-break:break-all}
.decision{display:inline-block;padding:.4em 1em;font-size:1.4em;font-weight:bold;color:#fff;
border-radius:.3em} .accept{background:#2e7d32} .tune{background:#ef6c00} .reject{background:#c62828}
.pass{color:#2e7d32;font-weight:bold} .fail{color:#c62828;font-weight:bold} .note{color:#555}
img{max-width:100%;border:1px solid #eee;margin:.4em 0}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any, unit: str = "") -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, (int, float)) and unit == "bytes":
        return f"{value / 2**30:.2f} GiB"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> str:
    """Cells are HTML already (escape values with _e / _fmt before passing them)."""
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


# --- figures -------------------------------------------------------------------------------------

def _render(draw: Callable, size: tuple[float, float]) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(figure)
    draw(figure)
    buffer = io.BytesIO()
    # No Software/date metadata: the same evidence renders to the same bytes.
    figure.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    return buffer.getvalue()


def _placeholder(figure, text: str) -> None:
    axes = figure.add_subplot()
    axes.axis("off")
    axes.text(0.5, 0.5, text, ha="center", va="center", fontsize=12, color="#555")


def draw_stages(evidence: dict) -> Callable:
    timings = evidence.get("timings") or {}
    seconds = [float(timings.get(f"{stage}_seconds") or 0.0) for stage in STAGES]

    def draw(figure):
        axes = figure.add_subplot()
        bars = axes.barh(STAGES[::-1], seconds[::-1], color="#4c72b0")
        axes.bar_label(bars, labels=[f"{s:.1f} s" for s in seconds[::-1]], padding=3)
        axes.set_xlabel("seconds")
        axes.set_title(f"stage times (total {float(timings.get('total_seconds') or 0):.1f} s)")
        axes.set_xlim(0, max(seconds + [1e-9]) * 1.2)
    return draw


def draw_steps(evidence: dict) -> Callable:
    steps = evidence.get("steps") or []
    gate = ((evidence.get("config") or {}).get("gates") or {}).get("minimum_valid_group_ratio")

    def draw(figure):
        if not steps:
            _placeholder(figure, "no completed update step")
            return
        from matplotlib.ticker import MaxNLocator

        x = [s["step"] for s in steps]
        reward, ratio, kl = figure.subplots(3, 1, sharex=True)
        reward.plot(x, [s["mean_reward"] for s in steps], "o-", color=CANDIDATE_COLOR)
        reward.set_ylabel("mean reward")
        reward.set_title("training rollouts per update step")
        ratio.plot(x, [s["valid_group_ratio"] for s in steps], "o-", color="#2ca02c")
        if isinstance(gate, (int, float)):
            ratio.axhline(gate, color="#c62828", linestyle="--", label=f"gate {gate:g}")
            ratio.legend(loc="best", fontsize=8)
        ratio.set_ylabel("valid group ratio")
        ratio.set_ylim(-0.05, 1.05)
        kl.plot(x, [s.get("mean_kl", 0.0) for s in steps], "o-", color="#9467bd", label="mean KL")
        clip = kl.twinx()
        clip.plot(x, [s.get("clip_fraction", 0.0) for s in steps], "s--", color="#8c564b",
                  label="clip fraction")
        kl.set_ylabel("mean KL")
        clip.set_ylabel("clip fraction")
        kl.set_xlabel("step")
        kl.xaxis.set_major_locator(MaxNLocator(integer=True))
        kl.legend(loc="upper left", fontsize=8)
        clip.legend(loc="upper right", fontsize=8)
    return draw


def draw_lengths(evidence: dict) -> Callable:
    comparison = evidence.get("comparison") or {}
    budget = (evidence.get("config") or {}).get("max_new_tokens")

    def draw(figure):
        axes = figure.add_subplot()
        for name, color in (("baseline", BASELINE_COLOR), ("candidate", CANDIDATE_COLOR)):
            histogram = (comparison.get(name) or {}).get("length_histogram")
            if histogram:
                mean = comparison[name]["length"]["mean"]
                axes.stairs(histogram["counts"], histogram["bin_edges"], color=color, linewidth=2,
                            fill=name == "baseline", alpha=0.35 if name == "baseline" else 1.0,
                            label=f"{name} (mean {mean:.1f} tokens)")
        if isinstance(budget, int):
            axes.axvline(budget, color="#c62828", linestyle="--", label=f"budget {budget} tokens")
        axes.set_xlabel("completion tokens")
        axes.set_ylabel("completions")
        axes.set_title("re-test completion lengths")
        axes.legend(loc="best", fontsize=8)
    return draw


def draw_per_prompt(evidence: dict) -> Callable:
    comparison = evidence.get("comparison") or {}
    baseline = {p["prompt_id"]: p for p in (comparison.get("baseline") or {}).get("per_prompt", [])}
    candidate = {p["prompt_id"]: p for p in (comparison.get("candidate") or {}).get("per_prompt", [])}
    prompts = sorted(set(baseline) & set(candidate),
                     key=lambda i: (candidate[i]["mean_reward"] - baseline[i]["mean_reward"], i))

    def draw(figure):
        if not prompts:
            _placeholder(figure, "no paired eval prompts recorded")
            return
        values, deltas = figure.subplots(1, 2, sharey=True)
        y = list(range(len(prompts)))
        before = [baseline[i]["mean_reward"] for i in prompts]
        after = [candidate[i]["mean_reward"] for i in prompts]
        values.hlines(y, before, after, color="#bbbbbb", zorder=1)
        # Hollow baseline rings around smaller candidate diamonds: equal values stay visible.
        values.scatter(before, y, s=90, facecolors="none", edgecolors=BASELINE_COLOR,
                       linewidths=1.5, label="baseline", zorder=2)
        values.scatter(after, y, s=25, color=CANDIDATE_COLOR, marker="D", label="candidate",
                       zorder=3)
        values.set_xlim(-0.05, 1.05)
        values.set_xlabel("mean reward")
        values.set_title("per-prompt mean reward")
        values.legend(loc="lower right", fontsize=8)
        values.set_yticks(y, prompts if len(prompts) <= 60 else [""] * len(prompts),
                          fontsize=7, family="monospace")
        # The paired differences themselves: what the bootstrap resamples and the sign test counts.
        change = [a - b for a, b in zip(after, before)]
        deltas.barh(y, change, color=["#2e7d32" if c > 0 else "#c62828" for c in change])
        deltas.axvline(0.0, color="#555", linewidth=0.8)
        deltas.set_xlim(-1.05, 1.05)
        deltas.set_xlabel("candidate - baseline")
        deltas.set_title("paired difference per prompt")
    return draw


def draw_intervals(evidence: dict) -> Callable:
    paired = (evidence.get("comparison") or {}).get("paired") or {}
    gates = (evidence.get("config") or {}).get("gates") or {}
    rows = [(name, paired[name], gates.get(gate)) for name, gate in (
        ("reward_mean_gain", "minimum_reward_gain"),
        ("pass_at_group_gain", "minimum_pass_at_group_gain"),
        ("pass_rate_gain", None)) if name in paired]

    def draw(figure):
        if not rows:
            _placeholder(figure, "no paired statistics recorded")
            return
        axes = figure.add_subplot()
        for y, (name, interval, gate) in enumerate(rows):
            axes.errorbar(interval["point"], y, xerr=[[interval["point"] - interval["low"]],
                                                      [interval["high"] - interval["point"]]],
                          fmt="o", color=CANDIDATE_COLOR, capsize=6)
            if isinstance(gate, (int, float)):
                axes.plot([gate], [y], marker="|", markersize=22, color="#c62828")
        axes.axvline(0.0, color="#555", linewidth=0.8)
        axes.set_yticks(range(len(rows)), [name for name, _, _ in rows])
        axes.set_ylim(-0.6, len(rows) - 0.4)
        confidence = paired.get("confidence", 0.95)
        axes.set_xlabel(f"candidate - baseline (point and {confidence:.0%} paired bootstrap "
                        "interval; red tick: gate minimum)")
    return draw


FIGURES = (("stages", draw_stages, (7.0, 3.0)), ("steps", draw_steps, (8.0, 7.0)),
           ("lengths", draw_lengths, (8.0, 3.6)), ("per_prompt", draw_per_prompt, (9.0, 4.5)),
           ("intervals", draw_intervals, (8.0, 2.8)))


# --- sections ------------------------------------------------------------------------------------

def _img(pngs: dict[str, bytes], name: str, alt: str) -> str:
    data = base64.b64encode(pngs[name]).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{_e(alt)}">'


def gates_section(evidence: dict) -> str:
    decision = evidence.get("decision") or {}
    verdict = str(decision.get("decision", "unknown"))
    failed = ", ".join(decision.get("failed_checks") or []) or "none"
    significant = ((evidence.get("config") or {}).get("gates") or {}).get("require_significant_gain")
    gain_measure = "bootstrap lower bound" if significant is True else "point estimate"
    rows = []
    for check in decision.get("checks") or []:
        unit = "bytes" if check.get("name") == "memory" else ""
        result = '<span class="pass">pass</span>' if check.get("passed") else (
            '<span class="fail">FAIL</span>')
        measure = gain_measure if check.get("name") in ("reward", "pass_at_group") else ""
        rows.append([_e(check.get("name")), _e(_fmt(check.get("value"), unit)),
                     _e(_fmt(check.get("threshold"), unit)), result, _e(check.get("on_fail")),
                     _e(measure)])
    return (f'<p><span class="decision {_e(verdict)}">{_e(verdict.upper())}</span> '
            f"status <code>{_e(evidence.get('status'))}</code>; failed checks: {_e(failed)}</p>"
            "<h2>Delivery gates</h2>"
            + _table(["check", "value", "threshold", "result", "on fail", "gain measure"], rows)
            + '<p class="note">Minimums and maximums are inclusive. The reward and pass_at_group '
            f"gates read the re-test gain's {_e(gain_measure)}"
            f"{' (require_significant_gain)' if significant is True else ''}.</p>")


def retest_section(evidence: dict, pngs: dict[str, bytes]) -> str:
    comparison = evidence.get("comparison") or {}
    baseline, candidate = comparison.get("baseline") or {}, comparison.get("candidate") or {}
    paired = comparison.get("paired") or {}
    rows = []
    for label, read in (("mean reward", lambda s: s.get("mean_reward")),
                        ("pass@group", lambda s: s.get("pass_at_group")),
                        ("max-length hit ratio", lambda s: s.get("max_length_hit_ratio")),
                        ("mean length", lambda s: (s.get("length") or {}).get("mean")),
                        ("median length", lambda s: (s.get("length") or {}).get("median")),
                        ("p90 length", lambda s: (s.get("length") or {}).get("p90"))):
        before, after = read(baseline), read(candidate)
        change = after - before if isinstance(before, (int, float)) and isinstance(
            after, (int, float)) else None
        rows.append([_e(label), _e(_fmt(before)), _e(_fmt(after)),
                     _e(f"{change:+.4g}" if change is not None else "n/a")])
    tests = []
    for name, test_name in (("reward_mean_gain", "sign_test"), ("pass_at_group_gain", "mcnemar"),
                            ("pass_rate_gain", "sign_test")):
        interval = paired.get(name)
        if interval:
            test = interval.get(test_name) or {}
            tests.append([_e(name), _e(_fmt(interval["point"])),
                          _e(f"[{interval['low']:.4g}, {interval['high']:.4g}]"),
                          _e(f"{test_name.replace('_', ' ')} p = {_fmt(test.get('p_value'))}"),
                          _e(", ".join(f"{k} {v}" for k, v in test.items() if k != "p_value"))])
    return (f"<h2>Independent re-test ({_e(baseline.get('prompt_count'))} eval prompts x "
            f"{_e(comparison.get('eval_group_size'))} samples, seed {_e(comparison.get('eval_seed'))})</h2>"
            + _table(["metric", "baseline", "candidate", "change"], rows)
            + f"<h3>Paired statistics ({_e(paired.get('resamples'))} bootstrap resamples, "
            f"seed {_e(paired.get('seed'))})</h3>"
            + _table(["gain", "point", f"{paired.get('confidence', 0.95):.0%} interval",
                      "exact test", "counts"], tests)
            + _img(pngs, "intervals", "bootstrap intervals of the gains")
            + _img(pngs, "per_prompt", "per-prompt baseline vs candidate")
            + _img(pngs, "lengths", "baseline vs candidate length histograms"))


def training_section(evidence: dict, pngs: dict[str, bytes]) -> str:
    rollout, update = evidence.get("rollout") or {}, evidence.get("update") or {}
    mismatch = update.get("sampler_trainer_mismatch") or {}
    facts = [("groups (valid / all)", f"{rollout.get('valid_group_count')} / {rollout.get('group_count')}"),
             ("valid group ratio", _fmt(rollout.get("valid_group_ratio"))),
             ("trajectories (effective / total)",
              f"{rollout.get('effective_trajectory_count')} / {rollout.get('total_trajectories')}"),
             ("effective trajectories / s", _fmt(evidence.get("effective_trajectories_per_second"))),
             ("max-length hit ratio", _fmt(rollout.get("max_length_hit_ratio"))),
             ("optimizer updates", _fmt(update.get("update_count"))),
             ("objective (loss_type, importance_sampling_level, num_iterations)",
              f"{update.get('loss_type')}, {update.get('importance_sampling_level')}, "
              f"{_fmt(update.get('num_iterations'))}"),
             ("advantages (scale_rewards) / top_entropy_quantile",
              f"{update.get('scale_rewards')} / {_fmt(update.get('top_entropy_quantile'))}"),
             ("clip epsilon / epsilon_high / delta / fraction clipped",
              f"{_fmt(update.get('epsilon'))} / {_fmt(update.get('epsilon_high'))} / "
              f"{_fmt(update.get('delta'))} / {_fmt(update.get('clip_fraction'))}"),
             ("beta / kl_estimator / mean KL", f"{_fmt(update.get('beta'))} / "
              f"{update.get('kl_estimator')} / {_fmt(update.get('mean_kl'))}"),
             ("mean entropy of the sampled tokens", _fmt(update.get("entropy"))),
             ("sampler-trainer |delta log p| mean / max, k3 KL",
              f"{_fmt(mismatch.get('mean_abs_logp'))} / {_fmt(mismatch.get('max_abs_logp'))}, "
              f"{_fmt(mismatch.get('k3_kl'))}"),
             ("rollout_correction (cap)",
              f"{update.get('rollout_correction')} ({_fmt(update.get('rollout_correction_cap'))})"),
             ("generation tokens / s", _fmt(rollout.get("generation_tokens_per_second")))]
    resources = evidence.get("resources") or {}
    facts += [(f"peak {kind} ({resources.get('device')})", _fmt(resources.get(f"peak_{kind}_bytes"), "bytes"))
              for kind in ("allocated", "reserved", "rss")]
    return ("<h2>Training and resources</h2>" + _table(["quantity", "value"],
                                                      [[_e(k), _e(v)] for k, v in facts])
            + _img(pngs, "steps", "reward, valid group ratio and KL per update step")
            + "<h2>Stage times</h2>" + _img(pngs, "stages", "stage time breakdown"))


def inputs_section(evidence: dict, manifest: dict) -> str:
    inputs, artifact = evidence.get("inputs") or {}, evidence.get("artifact") or {}
    verifier = inputs.get("verifier") or {}
    rows = [("base model", json.dumps(inputs.get("model"), sort_keys=True)),
            ("baseline adapter", json.dumps(inputs.get("baseline_adapter"))),
            ("baseline policy version", inputs.get("baseline_policy_version")),
            ("candidate policy version", artifact.get("new_policy_version")),
            ("candidate adapter", f"{artifact.get('path')} sha256 {artifact.get('sha256')}"),
            ("verifier", f"{verifier.get('name')} (version {verifier.get('version')})")]
    for name in ("train_set", "eval_set"):
        for key, value in (inputs.get(name) or {}).items():
            rows.append((f"{name}.{key}", json.dumps(value) if isinstance(value, dict) else value))
    files = manifest.get("files") or {}
    rows += [(f"run file {name}", f"sha256 {digest}") for name, digest in files.items()]
    return ("<h2>Input identities</h2>"
            + _table(["input", "identity"], [[_e(k), f"<code>{_e(v)}</code>"] for k, v in rows]))


def render_html(evidence: dict, manifest: dict, pngs: dict[str, bytes]) -> str:
    label = evidence.get("run_label", "run")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>grpogate report: {_e(label)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>grpogate run <code>{_e(label)}</code></h1>"
            f"<p class=\"note\">created {_e(evidence.get('created'))}; re-check with "
            f"<code>grpogate decide RUN_DIR</code></p>"
            + gates_section(evidence) + retest_section(evidence, pngs)
            + training_section(evidence, pngs) + inputs_section(evidence, manifest)
            + "</body></html>\n")


def write_report(run_dir: str | Path) -> Path:
    """Render report_*.png and report.html into `run_dir` (atomically); returns the HTML path."""
    run_dir = Path(run_dir)
    try:
        evidence = json.loads((run_dir / "evidence.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{run_dir}: not a run directory (no evidence.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{run_dir}/evidence.json: not valid JSON: {error}") from None
    try:  # the manifest only adds file hashes; a run without one still gets its report
        manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        manifest = {}
    pngs = {name: _render(draw(evidence), size) for name, draw, size in FIGURES}
    for name, data in pngs.items():
        atomic_write_bytes(run_dir / f"report_{name}.png", data)
    path = run_dir / REPORT_HTML
    atomic_write_bytes(path, render_html(evidence, manifest, pngs).encode("utf-8"))
    return path
