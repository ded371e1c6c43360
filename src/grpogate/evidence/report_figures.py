"""The report's figures, drawn from the stored evidence alone (PNG bytes, no display).

matplotlib's object API with the Agg canvas (no pyplot global state). Legends sit outside the
axes so they never cover data; steps are numbered 1..N as the terminal numbers them; the
per-prompt plot grows with the prompt count and labels prompts by their row in the report's
per-prompt table (#1 = the largest loss, sorted by paired difference), where the question is.
"""

from __future__ import annotations

import io
from typing import Callable

BASELINE_COLOR, CANDIDATE_COLOR = "#7f7f7f", "#1f77b4"
STAGES = ("load", "rollout", "verification", "update", "evaluation", "checkpoint")
ROW_INCHES = 0.17  # per prompt in the per-prompt plot: 7-point labels never overlap


def render(draw: Callable, size: tuple[float, float]) -> bytes:
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


def _outside_legend(axes) -> None:
    """Legend to the right of the axes, never over the data."""
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)


def stage_seconds(evidence: dict) -> list[tuple[str, float]]:
    """Every stage's seconds, checkpoints included, plus "other" (the rest of the total: set-up,
    delivery, evidence files), so the bars add up to the run's total."""
    timings = evidence.get("timings") or {}
    stages = [(stage, float(timings.get(f"{stage}_seconds") or 0.0)) for stage in STAGES]
    total = float(timings.get("total_seconds") or 0.0)
    return stages + [("other", max(total - sum(seconds for _, seconds in stages), 0.0))]


def draw_stages(evidence: dict) -> Callable:
    stages = stage_seconds(evidence)
    total = float((evidence.get("timings") or {}).get("total_seconds") or 0.0)

    def draw(figure):
        axes = figure.add_subplot()
        names, seconds = [n for n, _ in stages][::-1], [s for _, s in stages][::-1]
        bars = axes.barh(names, seconds, color="#4c72b0")
        axes.bar_label(bars, labels=[f"{s:.1f} s" for s in seconds], padding=3)
        axes.set_xlabel("seconds")
        axes.set_title(f"stage times (total {total:.1f} s)")
        axes.set_xlim(0, max(seconds + [1e-9]) * 1.2)
    return draw


def _non_negative(axes, values: list[float]) -> None:
    """KL and clip fractions are >= 0: the axis starts at 0 (an all-zero series gets 0..1)."""
    top = max(values, default=0.0)
    axes.set_ylim(0.0, top * 1.1 if top > 0 else 1.0)


def draw_steps(evidence: dict) -> Callable:
    steps = evidence.get("steps") or []
    gate = ((evidence.get("config") or {}).get("gates") or {}).get("minimum_valid_group_ratio")

    def draw(figure):
        if not steps:
            _placeholder(figure, "no completed update step")
            return
        from matplotlib.ticker import MaxNLocator

        x = [s["step"] + 1 for s in steps]  # the terminal's "step 1/16"
        reward, ratio, kl = figure.subplots(3, 1, sharex=True)
        reward.plot(x, [s["mean_reward"] for s in steps], "o-", color=CANDIDATE_COLOR,
                    label="mean reward")
        reward.set_ylabel("mean reward")
        reward.set_ylim(0.0, max(1e-9, *[s["mean_reward"] for s in steps]) * 1.1)
        reward.set_title("training rollouts per step")
        _outside_legend(reward)
        ratio.plot(x, [s["valid_group_ratio"] for s in steps], "o-", color="#2ca02c",
                   label="valid group ratio")
        if isinstance(gate, (int, float)):
            ratio.axhline(gate, color="#c62828", linestyle="--", label=f"gate {gate:g}")
        ratio.set_ylabel("valid group ratio")
        ratio.set_ylim(0.0, 1.05)
        _outside_legend(ratio)
        kls = [s.get("mean_kl", 0.0) for s in steps]
        clips = [s.get("clip_fraction", 0.0) for s in steps]
        kl.plot(x, kls, "o-", color="#9467bd", label="mean KL")
        _non_negative(kl, kls)
        clip = kl.twinx()
        clip.plot(x, clips, "s--", color="#8c564b", label="clip fraction")
        _non_negative(clip, clips)
        kl.set_ylabel("mean KL")
        clip.set_ylabel("clip fraction")
        kl.set_xlabel("step")
        kl.xaxis.set_major_locator(MaxNLocator(integer=True))
        handles = kl.get_legend_handles_labels()[0] + clip.get_legend_handles_labels()[0]
        kl.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.12, 1.0), fontsize=8,
                  borderaxespad=0)
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
        _outside_legend(axes)
    return draw


def paired_prompts(evidence: dict) -> list[tuple[str, float, float]]:
    """(prompt id, baseline, candidate mean reward) sorted by candidate - baseline, ascending:
    row #1 is the prompt the candidate lost most on. The report's table uses the same order."""
    comparison = evidence.get("comparison") or {}
    baseline = {p["prompt_id"]: p for p in (comparison.get("baseline") or {}).get("per_prompt", [])}
    candidate = {p["prompt_id"]: p for p in (comparison.get("candidate") or {}).get("per_prompt", [])}
    rows = [(i, baseline[i]["mean_reward"], candidate[i]["mean_reward"])
            for i in set(baseline) & set(candidate)]
    return sorted(rows, key=lambda row: (row[2] - row[1], row[0]))


def per_prompt_size(evidence: dict) -> tuple[float, float]:
    return (9.0, max(3.0, 1.4 + ROW_INCHES * len(paired_prompts(evidence))))


def draw_per_prompt(evidence: dict) -> Callable:
    rows = paired_prompts(evidence)

    def draw(figure):
        if not rows:
            _placeholder(figure, "no paired eval prompts recorded")
            return
        values, deltas = figure.subplots(1, 2, sharey=True)
        y = list(range(len(rows)))
        before, after = [r[1] for r in rows], [r[2] for r in rows]
        values.hlines(y, before, after, color="#bbbbbb", zorder=1)
        # Hollow baseline rings around smaller candidate diamonds: equal values stay visible.
        values.scatter(before, y, s=60, facecolors="none", edgecolors=BASELINE_COLOR,
                       linewidths=1.2, label="baseline", zorder=2)
        values.scatter(after, y, s=18, color=CANDIDATE_COLOR, marker="D", label="candidate",
                       zorder=3)
        values.set_xlim(-0.05, 1.05)
        values.set_ylim(-0.7, len(rows) - 0.3)
        values.invert_yaxis()  # #1 (largest loss) on top, as in the table
        values.set_xlabel("mean reward")
        values.set_title("per-prompt mean reward")
        # Above both panels, outside them: with 128 rows no corner of the axes is empty.
        figure.legend(*values.get_legend_handles_labels(), loc="outside upper center", ncol=2,
                      fontsize=8)
        values.set_yticks(y, [f"#{i + 1}" for i in y], fontsize=7)
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


def render_all(evidence: dict) -> dict[str, bytes]:
    figures = (("stages", draw_stages, (7.0, 3.2)), ("steps", draw_steps, (9.0, 7.0)),
               ("lengths", draw_lengths, (9.0, 3.6)),
               ("per_prompt", draw_per_prompt, per_prompt_size(evidence)),
               ("intervals", draw_intervals, (8.0, 2.8)))
    return {name: render(draw(evidence), size) for name, draw, size in figures}
