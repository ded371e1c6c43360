"""The run report: one self-contained HTML file (images embedded as data URIs) and its PNGs.

`write_report(run_dir)` reads only the run directory's files (evidence, manifest, problems,
re-test completions), so a report can be regenerated for any finished run. It shows the
decision, every gate and for each failed one what to try, the configuration that produced the
run, the re-test with its paired statistics, a per-prompt plot and table (question, reference),
real completions (best and worst per policy; the prompts where the policies differ most),
training curves, stage times and the input identities. The page makes no external request: no
scripts, no fonts, no links; every image is a PNG inlined as base64 (also written beside it as
report_*.png). The figures are drawn by report_figures.py.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from grpogate.config import profile_note
from grpogate.errors import InputError
from grpogate.evidence.decisions import gain_rule, gain_rule_line, no_change_reason
from grpogate.evidence.retest_checks import SEQUENTIAL_RULE, test_lines
from grpogate.evidence.manifest import PROBLEMS_FILE
from grpogate.evidence.report_advice import ADVICE
from grpogate.evidence.report_html import _STYLE, _e, _fmt, _h2, _img, _table
from grpogate.evidence.report_figures import paired_prompts, render_all, stage_seconds
from grpogate.files import atomic_write_bytes, jsonl_lines, parse_json, read_confined, tolerated

REPORT_HTML = "report.html"
FIGURE_NAMES = ("stages", "steps", "lengths", "per_prompt", "intervals")
# Every section's id, in page order ("what-to-try" only when a gate failed).
SECTIONS = ("gates", "what-to-try", "configuration", "re-test", "guard-drift", "per-prompt",
            "completions", "training", "stage-times", "inputs")




def gates_section(evidence: dict) -> str:
    decision = evidence.get("decision") or {}
    verdict = str(decision.get("decision", "unknown"))
    failed = ", ".join(decision.get("failed_checks") or []) or "none"
    gain_measure = gain_rule((evidence.get("config") or {}).get("gates"))
    significant = gain_measure == SEQUENTIAL_RULE
    rows = []
    for check in decision.get("checks") or []:
        unit = "bytes" if check.get("name") == "memory" else ""
        result = '<span class="pass">pass</span>' if check.get("passed") else (
            '<span class="fail">FAIL</span>')
        measure = gain_measure if check.get("name") in ("reward", "pass_at_group") else ""
        rows.append([_e(check.get("name")), _e(_fmt(check.get("value"), unit)),
                     _e(_fmt(check.get("threshold"), unit)), result, _e(check.get("on_fail")),
                     _e(measure)])
    profile = str((evidence.get("config") or {}).get("profile", ""))
    note = profile_note(profile)
    purpose = f'<p class="note"><b>profile {_e(profile)}</b>: {_e(note)}</p>' if note else ""
    return (f'<p><span class="decision {_e(verdict)}">{_e(verdict.upper())}</span> '
            f"status <code>{_e(evidence.get('status'))}</code>; failed checks: {_e(failed)}</p>"
            + (f'<p class="note"><b>{_e(reason)}</b></p>' if (reason := no_change_reason(
                evidence)) else "")
            + purpose
            + _h2("gates", "Delivery gates")
            + _table(["check", "value", "threshold", "result", "on fail", "gain measure"], rows)
            + '<p class="note">' + _e(gain_rule_line((evidence.get("config") or {}).get("gates")))
            + ". The gains are scored by the correctness verifier alone, whatever reward "
            "components the training used"
            + ("; a test's lower confidence bound is the value of its row" if significant
               else "") + ".</p>"
            + "".join(f'<p class="note">{_e(line)}</p>' for line in test_lines(decision)))


def advice_section(evidence: dict) -> str:
    failed = [c for c in (evidence.get("decision") or {}).get("checks") or [] if not c.get("passed")]
    if not failed:
        return ""
    items = "".join(f"<li><b>{_e(c.get('name'))}</b>: {_e(ADVICE.get(c.get('name'), 'see docs/design.md §5'))}</li>"
                    for c in failed)
    return _h2("what-to-try", "What to try") + f"<ul>{items}</ul>"


def configuration_section(evidence: dict) -> str:
    config = evidence.get("config") or {}
    task = config.get("task") or {}
    seeds = evidence.get("seeds") or {}
    steps = (config.get("train_prompts") or 0) // max(config.get("prompts_per_step") or 1, 1)
    rows = [
        ("objective", f"loss_type {config.get('loss_type')}, importance sampling "
                      f"{config.get('importance_sampling_level')}, epsilon {config.get('epsilon')} / "
                      f"{config.get('epsilon_high') or config.get('epsilon')}, num_iterations "
                      f"{config.get('num_iterations')}, scale_rewards {config.get('scale_rewards')}"),
        ("model", config.get("model")), ("baseline adapter", config.get("adapter") or "none"),
        ("task", f"{task.get('source')} {task.get('path' if task.get('source') in ('gsm8k', 'dataset') else 'name')} "
                 f"params {json.dumps(task.get('params'))}"),
        ("steps x prompts per step x G", f"{steps} x {config.get('prompts_per_step')} x "
                                         f"{config.get('group_size')}"),
        ("learning rate (AdamW), schedule, weight decay",
         f"{config.get('learning_rate')}, {config.get('lr_scheduler_type', 'constant')} "
         f"(warmup_ratio {config.get('warmup_ratio', 0.0)}), {config.get('weight_decay')}"),
        ("LoRA r / alpha / dropout / targets", f"{config.get('lora_r')} / {config.get('lora_alpha')} / "
                                               f"{config.get('lora_dropout')} / {config.get('lora_target_modules')}"),
        ("KL coefficient (beta)", f"{config.get('beta')} ({config.get('kl_estimator')})"),
        ("sampling", f"temperature {config.get('temperature')}, top_p {config.get('top_p')}, "
                     f"max_new_tokens {config.get('max_new_tokens')}"),
        ("re-test", f"{config.get('eval_prompts')} prompts x {config.get('eval_group_size')} samples"),
        ("seeds", ", ".join(f"{k} {v}" for k, v in seeds.items()) or f"run {config.get('seed')}"),
        ("task seeds", f"train {task.get('train_seed')}, eval {task.get('eval_seed')}"),
    ]
    return (_h2("configuration", "Configuration")
            + _table(["setting", "value"], [[_e(k), _e(v)] for k, v in rows])
            + '<p class="note">The full configuration is <code>config</code> in evidence.json.</p>')


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
    return (_h2("re-test", f"Independent re-test ({_e(baseline.get('prompt_count'))} eval "
                f"prompts x {_e(comparison.get('eval_group_size'))} samples, seed "
                f"{_e(comparison.get('eval_seed'))})")
            + _table(["metric", "baseline", "candidate", "change"], rows)
            + f"<h3>Paired statistics ({_e(paired.get('resamples'))} bootstrap resamples, "
            f"seed {_e(paired.get('seed'))})</h3>"
            + _table(["gain", "point", f"{paired.get('confidence', 0.95):.0%} interval",
                      "exact test", "counts"], tests)
            + _img(pngs, "intervals", "bootstrap intervals of the gains")
            + _img(pngs, "lengths", "baseline vs candidate length histograms"))


def _interval_text(paired: dict, name: str) -> str:
    interval = paired.get(name) or {}
    if not isinstance(interval.get("low"), (int, float)):
        return "n/a"
    return f"{interval['point']:+.4g} [{interval['low']:+.4g}, {interval['high']:+.4g}]"


def guard_drift_section(evidence: dict) -> str:
    """The guard set (baseline vs candidate, paired) and the drift of the re-test."""
    guard = evidence.get("guard")
    drift = (evidence.get("comparison") or {}).get("drift")
    if guard is None and drift is None:
        return ""  # a run recorded before either existed
    parts = [_h2("guard-drift", "Guard set and drift")]
    if not isinstance(guard, dict):
        parts.append("<p>no guard recorded</p>")
    elif not guard.get("enabled"):
        parts.append(f"<p>guard <b>off</b>: {_e(guard.get('note', ''))}</p>")
    elif guard.get("skipped"):
        parts.append("<p>guard not scored: the re-test was skipped</p>")
    else:
        task, paired = guard.get("task") or {}, guard.get("paired") or {}
        rows = [[_e(label), _e(_fmt((guard.get("baseline") or {}).get(key))),
                 _e(_fmt((guard.get("candidate") or {}).get(key))),
                 _e(_interval_text(paired, gain))]
                for label, key, gain in (("mean reward", "mean_reward", "reward_mean_gain"),
                                         ("pass@group", "pass_at_group", "pass_at_group_gain"))]
        sign = (paired.get("reward_mean_gain") or {}).get("sign_test") or {}
        parts += [f"<p>{_e(guard.get('prompts'))} problems of {_e(task.get('source'))} "
                  f"{_e(task.get('name'))} params {_e(json.dumps(task.get('params')))} (seed "
                  f"{_e(task.get('seed'))}) x {_e(guard.get('group_size'))} samples, disjoint "
                  "from the train and eval sets</p>",
                  _table(["guard", "baseline", "candidate", "gain [95 % paired interval]"], rows),
                  f'<p class="note">reward sign test p = {_e(_fmt(sign.get("p_value")))}; '
                  f"rule: {_e(guard.get('rule'))}</p>"]
    if isinstance(drift, dict):
        entropy = drift.get("entropy") or {}
        parts.append(_table(["drift on the re-test's fresh completions", "value"], [
            [_e("mean per-token KL(candidate || baseline)"), _e(_fmt(drift.get("kl_to_baseline")))],
            [_e("mean per-token entropy, baseline -> candidate"),
             _e(f"{_fmt(entropy.get('baseline'))} -> {_fmt(entropy.get('candidate'))}")]])
            + f'<p class="note">{_e(drift.get("measure"))}; {_e(drift.get("trust"))}</p>')
    return "".join(parts)


def per_prompt_section(evidence: dict, problems: dict, pngs: dict[str, bytes]) -> str:
    rows = []
    for rank, (prompt, before, after) in enumerate(paired_prompts(evidence), 1):
        problem = problems.get(prompt) or {}
        question = str(problem.get("question", "(problems.jsonl not available)"))
        short = question if len(question) <= 140 else question[:137] + "..."
        rows.append([f"#{rank}", f"<code>{_e(prompt)}</code>",
                     f'<span title="{_e(question)}">{_e(short)}</span>',
                     _e(problem.get("reference", "")), f"{before:.3f}", f"{after:.3f}",
                     f"{after - before:+.3f}"])
    return (_h2("per-prompt", "Per prompt, sorted by paired difference")
            + _img(pngs, "per_prompt", "per-prompt baseline vs candidate")
            + f"<details><summary>the {len(rows)} prompts (#1: the candidate's largest loss; "
            "hover a question for its full text)</summary>"
            + _table(["#", "prompt id", "question", "reference", "baseline", "candidate",
                      "difference"], rows) + "</details>")


def _completion_block(record: dict, problem: dict, title: str) -> str:
    budget = " (hit the budget)" if record.get("hit_max_length") else ""
    return (f"<h4>{_e(title)}: reward {_e(_fmt(record.get('reward')))}, "
            f"{_e(record.get('completion_tokens'))} tokens{budget}</h4>"
            + _table(["question", "reference", "completion"], [[
                f"<pre>{_e(problem.get('question', '(not available)'))}</pre>",
                f"<code>{_e(problem.get('reference', ''))}</code>",
                f"<pre>{_e(record.get('completion', ''))}</pre>"]]))


def completions_section(evidence: dict, eval_records: list[dict], problems: dict,
                        differing: int = 3) -> str:
    """Best and worst re-test completion of each policy, then the prompts where the policies
    differ most with one completion of each (the first sample, same seed for both)."""
    if not eval_records:
        return _h2("completions", "Completions") + "<p>no re-test completions recorded</p>"
    parts = [_h2("completions", "Completions (re-test)")]
    for policy in ("baseline", "candidate"):
        records = [r for r in eval_records if r.get("policy") == policy]
        if records:
            best = max(records, key=lambda r: r.get("reward") or 0.0)
            worst = min(records, key=lambda r: r.get("reward") or 0.0)
            if best.get("reward") == worst.get("reward"):  # one example says it all
                parts.append(_completion_block(best, problems.get(best.get("prompt_id"), {}),
                                               f"{policy}: every completion scored the same"))
                continue
            parts += [_completion_block(best, problems.get(best.get("prompt_id"), {}),
                                        f"{policy}, best"),
                      _completion_block(worst, problems.get(worst.get("prompt_id"), {}),
                                        f"{policy}, worst")]
    ranked = sorted(paired_prompts(evidence), key=lambda row: -abs(row[2] - row[1]))
    parts.append("<h3>Where baseline and candidate differ most</h3>")
    for prompt, before, after in [row for row in ranked if row[2] != row[1]][:differing]:
        first = {r.get("policy"): r for r in eval_records
                 if r.get("prompt_id") == prompt and r.get("sample_index") == 0}
        parts.append(f"<p>prompt <code>{_e(prompt)}</code>: mean reward {before:.3f} -> "
                     f"{after:.3f}</p>")
        for policy in ("baseline", "candidate"):
            if policy in first:
                parts.append(_completion_block(first[policy], problems.get(prompt, {}),
                                               f"{policy}, sample 0"))
    return "".join(parts)


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
             ("generation tokens / s", _fmt(rollout.get("generation_tokens_per_second"))),
             ("update: tokens trained / forwarded (padding share) / trained tokens per s",
              f"{_fmt(update.get('trained_tokens'))} / {_fmt(update.get('tokens_forwarded'))} "
              f"({_fmt(update.get('padding_fraction'))}) / "
              f"{_fmt(update.get('update_tokens_per_second'))}")]
    facts += _shaping_facts(evidence)
    resources = evidence.get("resources") or {}
    if resources.get("device") == "cuda":
        facts += [(f"peak {kind} (cuda)", _fmt(resources.get(f"peak_{kind}_bytes"), "bytes"))
                  for kind in ("allocated", "reserved")]
    # On the CPU the three peaks are one number (the resident set): shown once.
    facts.append(("peak resident set (process)", _fmt(resources.get("peak_rss_bytes"), "bytes")))
    stages = stage_seconds(evidence)
    # A run gated from another trainer (grpogate gate): say where these figures come from.
    foreign = (f'<p class="note">Trained by {_e((evidence.get("foreign") or {}).get("trainer"))}: '
               f'these figures are {_e(rollout["source_note"])}; the resources are '
               f'{_e(resources.get("measured"))}.</p>' if rollout.get("source_note") else "")
    return (_h2("training", "Training and resources") + foreign + _table(["quantity", "value"],
                                                              [[_e(k), _e(v)] for k, v in facts])
            + _img(pngs, "steps", "reward, valid group ratio and KL per step")
            + _update_steps_table(evidence)
            + _h2("stage-times", "Stage times")
            + _table(["stage", "seconds"], [[_e(n), f"{v:.2f}"] for n, v in stages]
                     + [["total", f"{sum(v for _, v in stages):.2f}"]])
            + _img(pngs, "stages", "stage time breakdown"))


def _update_steps_table(evidence: dict) -> str:
    """Per step, what the update computed and what it trained: padding is visible in every run."""
    rows = [[_fmt(s.get("step")), _fmt(s.get("tokens")), _fmt(s.get("tokens_forwarded")),
             _fmt(s.get("padding_fraction")), _fmt(s.get("update_seconds")),
             _fmt(s.get("update_tokens_per_second"))] for s in evidence.get("steps") or []]
    return _table(["step", "tokens trained", "tokens forwarded (with padding)", "padding share",
                   "update s", "trained tokens / s"], rows) if rows else ""


def _shaping_facts(evidence: dict) -> list[tuple[str, str]]:
    """Reward components, dynamic sampling, masked truncation and the sampler's truncation."""
    rollout, update = evidence.get("rollout") or {}, evidence.get("update") or {}
    means = rollout.get("reward_component_means") or {}
    facts = [(f"training reward {d.get('name')} x {_fmt(d.get('weight'))} (mean)",
              f"{_fmt(means.get(d.get('name')))}  [{d.get('version')}]")
             for d in (evidence.get("inputs") or {}).get("rewards") or []]
    facts.append(("multi-objective aggregation / reward errors",
                  f"{rollout.get('multi_objective_aggregation')} / "
                  f"{_fmt(rollout.get('reward_errors'))}"))
    dynamic = rollout.get("dynamic_sampling") or {}
    if dynamic.get("enabled"):
        facts.append(("dynamic sampling: prompts drawn / groups kept / refill prompts / refill s",
                      f"{dynamic.get('prompts_drawn')} / {dynamic.get('groups_kept')} / "
                      f"{dynamic.get('refill_prompts')} / "
                      f"{_fmt(dynamic.get('refill_generation_seconds'))}"))
    if update.get("mask_truncated_completions"):
        facts.append(("truncated completions masked out of the loss",
                      _fmt(update.get("masked_truncated_sequences"))))
    sampling = rollout.get("sampling") or {}
    facts.append(("sampling (temperature, top_p, top_k, min_p)",
                  ", ".join(_fmt(sampling.get(k)) for k in ("temperature", "top_p", "top_k",
                                                            "min_p"))
                  + f"; ratio against {sampling.get('ratio_old_logprobs')}"))
    return facts


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
    files = manifest.get("files")
    if isinstance(files, dict) and files:
        rows += [(f"run file {name}", f"sha256 {digest}") for name, digest in files.items()]
    else:  # said, not silently left out: `grpogate decide` names what is wrong with it
        rows.append(("run files", "not listed: manifest.json is missing or unreadable"))
    return (_h2("inputs", "Input identities")
            + _table(["input", "identity"], [[_e(k), f"<code>{_e(v)}</code>"] for k, v in rows]))


def render_html(evidence: dict, manifest: dict, pngs: dict[str, bytes], run_dir: str = "RUN_DIR",
                eval_records: list[dict] = (), problems: dict | None = None) -> str:
    label, problems = evidence.get("run_label", "run"), problems or {}
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>grpogate report: {_e(label)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>grpogate run <code>{_e(label)}</code></h1>"
            f"<p class=\"note\">created {_e(evidence.get('created'))}; re-check with "
            f"<code>grpogate decide {_e(shlex.quote(run_dir))}</code></p>"
            + gates_section(evidence) + advice_section(evidence)
            + configuration_section(evidence) + retest_section(evidence, pngs)
            + guard_drift_section(evidence) + per_prompt_section(evidence, problems, pngs)
            + completions_section(evidence, list(eval_records), problems)
            + training_section(evidence, pngs) + inputs_section(evidence, manifest)
            + "</body></html>\n")


def _read_jsonl(path: Path) -> list[dict]:
    """Records of an optional JSONL file; a missing or unreadable one is empty (the report still
    renders from the evidence; `grpogate decide` judges the files), one too large is refused."""
    with tolerated(InputError, OSError, UnicodeDecodeError, json.JSONDecodeError):
        lines = jsonl_lines(read_confined(path.parent, path.name), str(path))
        return [record for record in (parse_json(line, f"{path}:{number}")
                                      for number, line in enumerate(lines, 1) if line.strip())
                if isinstance(record, dict)]
    return []


def write_report(run_dir: str | Path) -> Path:
    """Render report_*.png and report.html into `run_dir` (atomically); returns the HTML path.
    Every file is read and everything rendered before the first is written."""
    shown, run_dir = str(run_dir), Path(run_dir)
    try:
        # Only a regular file inside the run directory is opened (a FIFO would hang the report).
        evidence = parse_json(read_confined(run_dir, "evidence.json"),
                              f"{run_dir}/evidence.json")
    except InputError as error:
        if not (run_dir / "evidence.json").is_file():
            raise InputError(f"{run_dir}: not a run directory (no evidence.json, or not a "
                             "regular file)") from None
        raise error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{run_dir}/evidence.json: not valid JSON: {error}") from None
    if not isinstance(evidence, dict):
        raise InputError(f"{run_dir}/evidence.json: not a JSON object")
    manifest = {}
    # The manifest only adds file hashes; a run without one still gets its report.
    with tolerated(InputError, json.JSONDecodeError, UnicodeDecodeError):
        manifest = parse_json(read_confined(run_dir, "manifest.json"),
                              f"{run_dir}/manifest.json")
    manifest = manifest if isinstance(manifest, dict) else {}
    problems = {str(p.get("prompt_id")): p for p in _read_jsonl(run_dir / PROBLEMS_FILE)}
    eval_records, pngs = _read_jsonl(run_dir / "eval_completions.jsonl"), render_all(evidence)
    html_text = render_html(evidence, manifest, pngs, shown, eval_records, problems)
    for name, data in pngs.items():
        atomic_write_bytes(run_dir / f"report_{name}.png", data)
    atomic_write_bytes(run_dir / REPORT_HTML, html_text.encode("utf-8"))
    return run_dir / REPORT_HTML
