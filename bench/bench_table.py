"""The benchmark's table: per-system rows, ratios against the faster TRL, targets, text layout.

Pure data in, data out (the paired bootstrap comes from grpogate.evidence.metrics): each child's result
dict and the shared re-test's summaries become one JSON-ready table and one printed table.
"""

from __future__ import annotations

import statistics

TRL_SYSTEMS = {"trl": True, "trl-nogc": False}  # name -> gradient checkpointing
ALL_SYSTEMS = ("grpogate", "trl", "trl-nogc")
GIB = 1024**3


def safe_div(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


def ratio(ours: float, theirs: float) -> float | None:
    """grpogate / TRL; None (JSON null) when TRL's value is zero and the ratio is undefined."""
    return ours / theirs if theirs > 0 else None


def system_row(result: dict, reward: float | None, ideal_tokens_per_second: float) -> dict:
    """One column of the table from one child's result (and the shared re-test's reward)."""
    steps = result["steps"]
    return {
        "seconds_per_step": statistics.fmean(st["seconds"] for st in steps) if steps else 0.0,
        "generation_tokens_per_second": result["generation_tokens_per_second"],
        "effective_trajectories_per_second": result["effective_trajectories_per_second"],
        "peak_rss_bytes": result["peak_rss_bytes"],
        "heldout_mean_reward": reward,
        "generation_peak_fraction": safe_div(result["generation_tokens_per_second"],
                                             ideal_tokens_per_second),
        "effective_trajectories_per_second_wall": safe_div(
            result["effective_trajectory_count"], sum(st["seconds"] for st in steps)),
        # grpogate: its update stage; TRL: the step minus its generation (reward, log-prob
        # forwards, backward and optimizer step: it has no separate update timer).
        "update_share_of_step": (safe_div(sum(st["update_seconds"] for st in steps),
                                          sum(st["seconds"] for st in steps))
                                 if steps and all("update_seconds" in st for st in steps) else None),
    }


def build_table(settings: dict, results: dict, ideal: dict, evaluation: dict | None) -> dict:
    """Assemble the JSON table: per-system rows, ratios against the faster TRL, the peak fraction."""
    from grpogate.evidence.metrics import paired_comparison

    summaries = (evaluation or {}).get("summaries", {})
    rewards = {name: summary["mean_reward"] for name, summary in summaries.items()}
    rows = {name: system_row(result, rewards.get(name), ideal["tokens_per_second"])
            for name, result in results.items()}
    trl_rows = {name: row for name, row in rows.items() if name in TRL_SYSTEMS}
    # "Faster" = fewer seconds per step (a full rollout + update), the way TRL's configurations
    # differ; every ratio below is taken against that one configuration.
    faster = min(trl_rows, key=lambda name: trl_rows[name]["seconds_per_step"]) if trl_rows else None
    table = {"settings": settings, "systems": rows, "raw": results, "ideal": ideal,
             "faster_trl": faster, "heldout_mean_reward": rewards}
    ours = rows.get("grpogate")
    if ours:
        table["generation_peak_fraction"] = ours["generation_peak_fraction"]
    comparisons = {}
    if "grpogate" in summaries:
        for other in [n for n in summaries if n != "grpogate"]:
            comparisons[f"grpogate_minus_{other}"] = paired_comparison(
                summaries[other], summaries["grpogate"], seed=settings["seed"])
    table["heldout_comparison"] = comparisons
    table["notes"] = consistency_notes(results, rewards)
    if ours and faster:
        theirs = rows[faster]
        best_trl = max(r["effective_trajectories_per_second"] for r in trl_rows.values())
        table.update({
            "effective_trajectories_per_second_ratio": ratio(
                ours["effective_trajectories_per_second"], theirs["effective_trajectories_per_second"]),
            "effective_trajectories_per_second_ratio_wall": ratio(
                ours["effective_trajectories_per_second_wall"],
                theirs["effective_trajectories_per_second_wall"]),
            "effective_trajectories_per_second_ratio_vs_best_trl": ratio(
                ours["effective_trajectories_per_second"], best_trl),
            "seconds_per_step_ratio": ratio(ours["seconds_per_step"], theirs["seconds_per_step"]),
            "generation_tokens_per_second_ratio": ratio(ours["generation_tokens_per_second"],
                                                        theirs["generation_tokens_per_second"]),
            "peak_rss_ratio": ratio(ours["peak_rss_bytes"], theirs["peak_rss_bytes"]),
        })
        gap = comparisons.get(f"grpogate_minus_{faster}", {}).get("reward_mean_gain")
        table["targets"] = {
            # An undefined ratio (TRL had no valid group) meets no target.
            "effective_trajectories_per_second_ratio >= 4":
                (table["effective_trajectories_per_second_ratio"] or 0.0) >= 4,
            "generation_peak_fraction >= 0.5": table["generation_peak_fraction"] >= 0.5,
            "peak_rss_ratio <= 1": table["peak_rss_ratio"] is not None and table["peak_rss_ratio"] <= 1,
            # Not lower than TRL by more than the paired bootstrap interval: its upper end >= 0.
            "heldout reward not significantly below TRL": gap is not None and gap["high"] >= 0,
        }
    return table


def consistency_notes(results: dict, rewards: dict) -> list[str]:
    """Cross-checks that should hold; each broken one is printed under the table."""
    notes = []
    for name, result in results.items():
        if result.get("prompt_tokens_match_grpogate") is False:
            notes.append(f"{name}: its prompt token ids differ from grpogate's encoding")
        active = result.get("checkpointing_active_in_model")
        if name in TRL_SYSTEMS and active is not None and active != TRL_SYSTEMS[name]:
            notes.append(f"{name}: gradient checkpointing was {'on' if active else 'off'} in the model")
    internal = results.get("grpogate", {}).get("internal_retest_mean_reward", {})
    if "grpogate" in rewards and "candidate" in internal and \
            abs(internal["candidate"] - rewards["grpogate"]) > 1e-9:
        notes.append(f"grpogate's own re-test gave {internal['candidate']:.3f}, the shared "
                     f"re-test {rewards['grpogate']:.3f} (reloaded adapter should match)")
    return notes


ROWS = [("seconds per step", "seconds_per_step", "{:.1f}"),
        ("generation tokens/s", "generation_tokens_per_second", "{:.1f}"),
        ("generation peak fraction", "generation_peak_fraction", "{:.3f}"),
        ("effective trajectories/s", "effective_trajectories_per_second", "{:.3f}"),
        ("  same, over wall seconds", "effective_trajectories_per_second_wall", "{:.3f}"),
        ("update share of step time", "update_share_of_step", "{:.2f}"),
        ("peak resident memory GiB", "peak_rss_bytes", "{:.2f}"),
        ("held-out mean reward", "heldout_mean_reward", "{:.3f}")]


def format_table(table: dict) -> str:
    """The one table: a column per system, then grpogate / the faster TRL configuration."""
    rows, faster = table["systems"], table.get("faster_trl")
    names = [n for n in ALL_SYSTEMS if n in rows]
    ratio_header = f"grpogate / {faster}" if faster and "grpogate" in rows else ""
    lines = ["  ".join([f"{'':26}"] + [f"{n:>10}" for n in names]
                       + ([f"{ratio_header:>24}"] if ratio_header else []))]
    for label, key, fmt in ROWS:
        cells = []
        for name in names:
            value = rows[name][key]
            value = value / GIB if key == "peak_rss_bytes" and value is not None else value
            cells.append(f"{fmt.format(value) if value is not None else '-':>10}")
        if ratio_header:
            ours, theirs = rows["grpogate"][key], rows[faster][key]
            gap = table["heldout_comparison"].get(f"grpogate_minus_{faster}")
            if key == "heldout_mean_reward" and gap:  # a difference with its paired interval
                g = gap["reward_mean_gain"]
                ratio = f"{g['point']:+.3f} [{g['low']:+.3f},{g['high']:+.3f}]"
            else:
                ratio = f"{ours / theirs:.2f}x" if ours is not None and theirs else "-"
            cells.append(f"{ratio:>24}")
        lines.append("  ".join([f"{label:26}"] + cells))
    ideal = table["ideal"]
    kernels = ideal.get("by_kernel") or [{"dtype": d, **m} for d, m in ideal["by_dtype"].items()]
    lines += ["", f"ideal decode step ({ideal['linear_maps']} linear maps, batch {ideal['batch_size']}, "
              f"no attention): " + ", ".join(
                  f"{m['dtype']}{' ' + m['kernel'] if 'kernel' in m else ''} "
                  f"{m['tokens_per_second']:.0f} tokens/s" for m in kernels)
              + f"; peak fractions use {ideal['dtype']}"
              + (f" {ideal['kernel']}" if "kernel" in ideal else "")
              + (", the fastest of {} timings ({})".format(
                  len(ideal["timings_tokens_per_second"]),
                  ", ".join(f"{t:.0f}" for t in ideal["timings_tokens_per_second"]))
                 if "timings_tokens_per_second" in ideal else "")]
    rewards = table["heldout_mean_reward"]
    if "baseline" in rewards:
        lines.append(f"held-out baseline (untrained) mean reward: {rewards['baseline']:.3f}")
    for name, comparison in table["heldout_comparison"].items():
        gain = comparison["reward_mean_gain"]
        lines.append(f"{name.replace('_', ' ')}: {gain['point']:+.3f} "
                     f"[{gain['low']:+.3f}, {gain['high']:+.3f}] (95 % paired bootstrap over "
                     f"{comparison['prompt_count']} prompts x {table['settings']['eval_samples']})")
    for target, passed in table.get("targets", {}).items():
        lines.append(f"target {target}: {'met' if passed else 'NOT met'}")
    lines += [f"note: {note}" for note in table.get("notes", [])]
    return "\n".join(lines)
