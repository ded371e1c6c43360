"""The report's figures are readable: labels that do not collide, legends off the data, steps 1..N."""

from __future__ import annotations

import random

import pytest

from grpogate.evidence.report_figures import (draw_per_prompt, draw_steps, paired_prompts,
                                              per_prompt_size, stage_seconds)


def figure_for(draw, size):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout="constrained")
    canvas = FigureCanvasAgg(figure)
    draw(figure)
    canvas.draw()
    return figure, canvas.get_renderer()


def evidence_with_prompts(count: int) -> dict:
    generator = random.Random(count)
    per_prompt = {side: [{"prompt_id": f"p{i:03d}", "mean_reward": generator.choice([0, .25, .5, .75, 1])}
                         for i in range(count)] for side in ("baseline", "candidate")}
    return {"comparison": {side: {"per_prompt": rows} for side, rows in per_prompt.items()}}


@pytest.mark.parametrize("count", [48, 128])
def test_per_prompt_labels_never_overlap(count):
    evidence = evidence_with_prompts(count)
    figure, renderer = figure_for(draw_per_prompt(evidence), per_prompt_size(evidence))
    axes = figure.axes[0]
    labels = [t for t in axes.get_yticklabels() if t.get_text()]
    assert [t.get_text() for t in labels] == [f"#{i}" for i in range(1, count + 1)]
    boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.y0)
    for lower, upper in zip(boxes, boxes[1:]):
        assert lower.y1 <= upper.y0 + 0.5, (lower, upper)  # half a pixel of anti-aliasing
    (legend,) = figure.legends
    for panel in figure.axes:  # neither the data nor the panel titles are covered
        assert not legend.get_window_extent(renderer).overlaps(panel.get_window_extent(renderer))
        assert not legend.get_window_extent(renderer).overlaps(
            panel.title.get_window_extent(renderer))


def test_per_prompt_rows_are_sorted_by_difference():
    rows = paired_prompts(evidence_with_prompts(48))
    differences = [after - before for _, before, after in rows]
    assert differences == sorted(differences)


STEPS = [{"step": i, "mean_reward": 0.1 * i, "valid_group_ratio": 0.5, "mean_kl": 0.0,
          "clip_fraction": 0.0} for i in range(4)]


def test_steps_are_numbered_like_the_terminal_and_legends_stay_off_the_data():
    evidence = {"steps": STEPS, "config": {"gates": {"minimum_valid_group_ratio": 0.2}}}
    figure, renderer = figure_for(draw_steps(evidence), (9.0, 7.0))
    reward = figure.axes[0]
    assert list(reward.get_lines()[0].get_xdata()) == [1, 2, 3, 4]  # step 1/4 .. 4/4
    for axes in figure.axes:
        legend = axes.get_legend()
        if legend is not None:
            assert not legend.get_window_extent(renderer).overlaps(axes.get_window_extent(renderer))
    # KL and clip fraction are all zero here: their axes start at 0, not below it.
    for axes in figure.axes[2:]:
        assert axes.get_ylim() == (0.0, 1.0)


def test_stage_times_include_checkpoints_and_add_up_to_the_total():
    timings = {"load_seconds": 1.0, "rollout_seconds": 2.0, "verification_seconds": 0.5,
               "update_seconds": 3.0, "evaluation_seconds": 1.5, "checkpoint_seconds": 0.75,
               "total_seconds": 10.0}
    stages = dict(stage_seconds({"timings": timings}))
    assert stages["checkpoint"] == 0.75
    assert stages["other"] == pytest.approx(1.25)  # 10 - (1 + 2 + 0.5 + 3 + 1.5 + 0.75)
    assert sum(stages.values()) == pytest.approx(10.0)
