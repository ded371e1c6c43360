"""What a dry run prints (`grpogate run --dry-run`, `grpogate gate --dry-run`).

With --json: the report as JSON, alone on stdout (`| jq` reads it), the closing sentence on
stderr. Without: a short summary a user reads before giving the machine to the run (the model
and its revision, the engine, device and dtype, the prompts, the re-test's plan, the gates,
memory and time where the report has them), ending in the sentence on stdout.
"""

from __future__ import annotations

from grpogate.cli.terminal import console, human_bytes, messages, print_json
from grpogate.errors import plain

PASSED = "dry run passed: configuration, inputs and environment are usable"


def print_dry_run(report: dict, as_json: bool) -> None:
    if as_json:
        print_json(report)
        messages.print(PASSED)
        return
    for line in summary_lines(report):
        console.print(plain(line), soft_wrap=True)
    console.print(PASSED)


def summary_lines(report: dict) -> list[str]:
    """The report in a few lines, one subject each."""
    lines = [f"model: {model_words(report.get('model') or report['baseline'])}"]
    if "candidate" in report:
        lines += candidate_lines(report)
    elif report.get("adapter"):
        lines.append(f"baseline adapter: {report['adapter']}")
    engine = report["engine"]
    lines.append(f"engine: {engine['name']}"
                 + (f" ({engine['declined']})" if engine.get("declined") else "")
                 + f"; device {report['device']}, dtype {report['dtype']}")
    prompts = [f"{report[key]} {name}" for key, name in (
        ("train_prompts", "train"), ("eval_prompts", "eval"), ("guard_prompts", "guard"))
        if report.get(key) is not None]
    steps = f"; {report['steps']} steps" if report.get("steps") is not None else ""
    lines.append(f"prompts: {', '.join(prompts)}{steps}")
    lines.append(f"re-test: {plan_words(report['retest_plan'], report['gates'])}")
    lines.append(f"gates: {gates_words(report['gates'])}")
    lines += cost_lines(report)
    lines.append(f"run directory: {report['run_dir']} (not created by the dry run)")
    return lines


def model_words(identity: dict) -> str:
    """The model as the run will load it: a hub id at its commit, a file or folder by hash."""
    if identity["kind"] == "hf-id":
        return f"{identity['location']} at commit {identity['revision']} (Hugging Face cache)"
    name = identity.get("spec") or identity["location"]
    return f"{name} ({identity['kind']}, sha256 {identity['sha256'][:12]})"


def plan_words(plan: dict | None, gates: dict) -> str:
    """The sequential re-test's plan: its looks, most completions, and the smallest gain and
    guard loss it resolves with probability 0.8 at the planning spreads (stopping.plan)."""
    if plan is None:
        return "one look at the eval prompts (no sequential design in this config)"
    guard = plan.get("resolvable_guard_gain_beyond_margin")
    margin = float(gates.get("maximum_guard_reward_loss", 0.0))
    guard_words = ("no guard set" if guard is None else
                   f"guard: a true change of {guard - margin:+.3f} or better passes its "
                   f"{margin:g} loss margin")
    return (f"at most {plan['eval_looks']} looks and {plan['max_completions']:,} completions; "
            f"smallest gain it resolves (probability 0.8): reward "
            f"{_figure(plan['resolvable_reward_gain'])}, pass@group "
            f"{_figure(plan['resolvable_pass_at_group_gain'])}; {guard_words}"
            + _sizes(plan.get("eval_prompts_to_show_gain") or {}))


def _sizes(prompts_for: dict) -> str:
    """"; a reward gain of +0.30 shown by 64 eval prompts, ..." (0.8), from the plan."""
    shown = [f"{gain} by {prompts} eval prompts" for gain, prompts in
             sorted(prompts_for.items(), reverse=True) if prompts is not None]
    return f"; a reward gain shown (probability 0.8) of {', '.join(shown)}" if shown else ""


def _figure(value: float | None) -> str:
    return "none within its maximum" if value is None else f"{value:+.3f}"


def gates_words(gates: dict) -> str:
    shown = []
    for name, value in gates.items():
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif name.endswith("_bytes"):
            value = human_bytes(value)
        shown.append(f"{name} {value}")
    return ", ".join(shown)


def cost_lines(report: dict) -> list[str]:
    """Memory and time: the expected peak beside the bound a run is refused at, the expected
    and upper wall time measured on this machine."""
    memory, time = report["memory_estimate_gib"], report["time_estimate"]
    return [f"memory: about {memory['expected_peak']:.1f} GiB at peak (refused when its bound, "
            f"{memory['refusal_bound']:.1f} GiB, exceeds what is free)",
            f"time on this machine: about {_duration(time['expected_seconds']['total'])} (at "
            f"most about {_duration(time['upper_seconds']['total'])}), measured for engine "
            f"{time['assumed']['engine']}, {time['assumed']['dtype']}"]


def _duration(seconds: float) -> str:
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def candidate_lines(report: dict) -> list[str]:
    """What only a gate's dry run says: the candidate, whether it fits the baseline, its
    weights' values and the isolation of the eval prompts."""
    from grpogate.inputs.candidate_dir import finite_weights_line

    candidate = report["candidate"]
    lines = [f"candidate: {candidate['kind']} {candidate['directory']} "
             f"({len(candidate['weights'])} weight file(s); "
             f"pickles not loaded: {', '.join(candidate['pickles_not_loaded']) or 'none'})"]
    identity = report["baseline_identity"]
    lines.append(f"baseline identity: {identity['how']}"
                 + ("" if identity["matches"] else " (the gate delivers reject: "
                    "baseline_identity)"))
    lines.append(finite_weights_line(report["finite_weights"]))
    isolation = report["isolation"]
    if not isolation.get("checked"):
        lines.append(isolation.get("note", "isolation not checked"))
    return lines
