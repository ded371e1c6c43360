"""What `grpogate run` (and `gate`) and `grpogate decide` print at the end: the gates table, the
rule the gain gates read, the re-test, guard and drift lines, what decide re-scored, the
mismatches, and the decision. Every name and value read from a run directory prints as text."""

from __future__ import annotations

import json

import typer

from grpogate.cli.terminal import DECISION_EXIT_CODES, DECISION_STYLE, console, gates_table
from grpogate.errors import command, plain
from grpogate.evidence.retest_checks import test_lines

def safety_lines(evidence: dict) -> list[str]:
    """The guard set's paired gain and the re-test drift, one line each (when recorded)."""
    lines = []
    guard = evidence.get("guard")
    if isinstance(guard, dict) and not guard.get("enabled"):
        lines.append(f"guard: {guard.get('note', 'off')}")
    elif isinstance(guard, dict) and not guard.get("skipped"):
        gain = guard["paired"]["reward_mean_gain"]
        lines.append(f"guard ({guard['task']['name']}, {guard['prompts']} prompts x "
                     f"{guard['group_size']}): mean reward {guard['baseline']['mean_reward']:.4f} "
                     f"-> {guard['candidate']['mean_reward']:.4f}, gain {gain['point']:+.4f} "
                     f"[{gain['low']:+.4f}, {gain['high']:+.4f}]")
    drift = evidence["comparison"].get("drift")
    if isinstance(drift, dict) and drift.get("non_finite_completions"):
        lines.append(f"drift on the re-test: {drift['non_finite_completions']} completions gave "
                     "NaN or infinite entropy or KL (recorded as null; finite_retest fails)")
    elif isinstance(drift, dict) and drift.get("kl_to_baseline") is not None:
        entropy = drift["entropy"]
        lines.append(f"drift on the re-test: KL(candidate || baseline) "
                     f"{drift['kl_to_baseline']:.4f} per token, entropy "
                     f"{entropy['baseline']:.4f} -> {entropy['candidate']:.4f}")
    return lines


def print_run_result(evidence: dict, exit_code_from_decision: bool) -> None:
    """The gates table, the re-test line and the decision; exits with the run's code."""
    from grpogate.config import profile_note
    from grpogate.evidence.audit_files import no_change_words
    from grpogate.evidence.decisions import gain_rule_line
    from grpogate.interrupts import exit_code

    decision = evidence["decision"]
    console.print(gates_table(decision))
    console.print(gain_rule_line(evidence["config"]["gates"]))
    comparison = evidence["comparison"]
    if comparison.get("skipped"):
        console.print("re-test skipped: the run stopped before it")
    else:
        console.print(
            f"re-test (correctness verifier alone) mean reward "
            f"{comparison['baseline']['mean_reward']:.4f} -> "
            f"{comparison['candidate']['mean_reward']:.4f}, pass@group "
            f"{comparison['baseline']['pass_at_group']:.4f} -> "
            f"{comparison['candidate']['pass_at_group']:.4f}")
    for line in safety_lines(evidence) + test_lines(decision):
        console.print(line, soft_wrap=True)
    if reason := no_change_words(evidence, evidence["run_dir"]):
        console.print(f"[bold red]{reason}[/]", soft_wrap=True)
    dynamic = evidence["rollout"].get("dynamic_sampling") or {}
    if dynamic.get("enabled"):
        console.print(f"dynamic sampling: {dynamic['prompts_drawn']} prompts drawn, "
                      f"{dynamic['groups_kept']} groups kept, {dynamic['refill_prompts']} refill "
                      f"prompts costing {dynamic['refill_generation_seconds']:.1f} s of generation")
    style = DECISION_STYLE[decision["decision"]]
    failed = ", ".join(decision["failed_checks"]) or "none"
    console.print(f"decision: [{style}]{decision['decision']}[/] (failed checks: {failed})")
    note = profile_note(evidence["config"]["profile"])
    if note:
        console.print(f"[yellow]profile {plain(evidence['config']['profile'])}:[/] "
                      f"{plain(note)}", soft_wrap=True)
    console.print(f"evidence: {plain(evidence['run_dir'])}/manifest.json (re-check: "
                  f"{command('grpogate', 'decide', evidence['run_dir'])})", soft_wrap=True)
    if evidence["interruption"]:
        stopped = evidence["interruption"]
        console.print(f"[bold red]interrupted by {stopped['signal']}[/] {stopped['safe_point']} "
                      f"after {stopped['completed_steps']} finished step(s); continue it with "
                      f"`{command('grpogate', 'run', '--resume', evidence['run_dir'])}`",
                      soft_wrap=True)
        raise typer.Exit(exit_code(stopped["signal"]))
    if evidence["failure"]:
        console.print(f"[bold red]{evidence['status']}[/] at step {evidence['failure']['step']}: "
                      f"{plain(evidence['failure']['message'])}", soft_wrap=True)
    if exit_code_from_decision:
        raise typer.Exit(DECISION_EXIT_CODES[decision["decision"]])


def rescoring_line(rescoring: dict) -> str:
    """What decide re-scored and what it took as recorded, in one line."""
    def names(key: str) -> str:  # names come from the run directory: shown as text
        return ", ".join(n if n.isprintable() else ascii(n) for n in map(str, rescoring[key]))

    line = f"re-scored: {names('components_rescored')}"
    if rescoring["components_as_recorded"]:
        line += (f"; taken as recorded (user code, not run): "
                 f"{names('components_as_recorded')} (re-score with "
                 "--trust-reward-code MODULE:FUNCTION)")
    if rescoring["sample_seed"] is not None:
        line += (f"; verifier re-run on {rescoring['records_rescored']} of "
                 f"{rescoring['records']} records (random sample, seed {rescoring['sample_seed']}),"
                 " the others' values taken as recorded")
    return line


def print_audit_lines(audit: dict, verify_key) -> None:
    """Non-default gates, signature, replay and mismatches: every name and value in them is
    read from the run directory, so each prints as text."""
    if audit.get("not_checkable"):  # a gated foreign run: what its files cannot prove
        console.print(f"[yellow]not re-checkable:[/] {plain(audit['not_checkable'])}",
                      soft_wrap=True)
    for name, gate in audit.get("non_default_gates", {}).items():
        console.print(f"[yellow]non-default gate[/] {plain(name)} = {plain(repr(gate['value']))} "
                      f"(default {plain(repr(gate['default']))})", soft_wrap=True)
    if audit.get("signature", {}).get("verified"):
        console.print(f"signature: run.sig verifies with {plain(verify_key)}", soft_wrap=True)
    if audit.get("rescoring"):
        console.print(rescoring_line(audit["rescoring"]), soft_wrap=True, markup=False,
                      highlight=False)
    if "replay" in audit:
        from grpogate.review.replay import replay_summary

        console.print(plain(replay_summary(audit["replay"])), soft_wrap=True)
    for mismatch in audit["mismatches"][:50]:
        console.print(f"[red]mismatch[/] {plain(mismatch['field'])}: recorded "
                      f"{plain(_short(mismatch['recorded']))}, recomputed "
                      f"{plain(_short(mismatch['recomputed']))}", soft_wrap=True)


def _short(value, limit: int = 80) -> str:
    """`value` as JSON (a string as itself) cut to `limit` characters. Only the chunks shown are
    encoded (iterencode yields them one at a time): a recorded value of many megabytes is
    never serialized whole to show 80 characters of it."""
    if isinstance(value, str):
        text = value[:limit + 1]
    else:
        text = ""
        for chunk in json.JSONEncoder().iterencode(value):
            text += chunk[:limit + 1 - len(text)]
            if len(text) > limit:
                break
    return text if len(text) <= limit else text[:limit - 3] + "..."
