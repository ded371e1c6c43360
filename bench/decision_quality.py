"""How often is the decision wrong? The re-test's gates on resampled re-tests of real completions.

    python bench/decision_quality.py --work-dir DIR [--candidate ADAPTER_DIR ...]
        [--exclude-run RUN_DIR] [--eval-pool 1024] [--eval-samples 8] [--guard-pool 100]
        [--guard-samples 64] [--draws 2000] [--seed 0] [--pools-only]
        [--mixtures 0.2,0.4,1:2:null,1:2:guard] [--set KEY=VALUE ...]
    python bench/decision_quality.py --work-dir DIR --quick
    python bench/decision_quality.py --work-dir DIR --real-retests 100 [--perturbed 0.002]
        [--candidate ADAPTER_DIR ...] [--exclude-run RUN_DIR]

Each policy (the baseline, a null candidate this script builds, every --candidate adapter)
answers a pool of eval prompts and a pool of guard prompts, several samples each, through
`grpogate eval`'s own code path (`review.standalone_eval.evaluate_standalone`: the run's
sampling settings, verifier and re-test seed, so sample k of a prompt has the same seed for
every policy). Pools are cached in DIR/pools as JSONL, keyed by the policy's identity (base
model and adapter weights' sha256) and the pool design, and generated once. The re-test
design and the gates are the default profile's (`config.load_config`): the sequential re-test
of evidence/stopping.py, eval prompts in batches of eval_batch_prompts up to eval_prompts
(x eval_group_size), guard rounds of guard.group_size samples of each of guard.prompts
problems up to guard.rounds. The eval pool defaults to the run's own eval population
(task.eval_pool: the first 1,024 distinct problems of the eval seed, which the run shuffles and
draws from), the guard pool to the guard's population (its first guard.prompts problems), with
64 samples each (twice the 16 rounds x 2 a guard can take: no sample repeats within a draw).
`decision_resample` draws that design from the pools --draws times, each draw stopping where
the rule stops, and judges every draw with the product's evidence assembly and `decide_run`;
it records the completions each re-test used beside the fixed design's 128 x 4 + 64 x 4 a
policy. The results go to DIR/decision_quality.json and DIR/decision_quality.md.

The null candidate is a PEFT LoRA adapter saved with every B = 0 (grpogate's own fresh
adapter, `inputs.policy.save_adapter`): its own file and hash, the baseline's function.
--mixtures adds graded policies (bench/decision_mixtures.py): `SHARE` mixes the first
--candidate into the baseline, each sample the candidate's with that probability (one seeded
coin per sample, so every completion is real and the true gains fall between); `A:B:SHARE`
mixes policy B into policy A (0 the baseline, k the k-th --candidate); `A:B:null` is the weak
null: the share is tuned so the true reward gain on the pool is 0 +- 0.005 (a gaining A and a
damaging B give skewed per-prompt differences with no mean gain).
`A:B:guard` tunes it so the true guard gain is -gates.maximum_guard_reward_loss (a
candidate at the guard's margin: P(accept) there is the guard's error rate).
--exclude-run skips a run's training prompts while drawing the eval pool (its candidates'
true gains are then on prompts they never trained on). --quick runs everything on a tiny
random Llama with tiny pools, in seconds: it proves the machinery and measures nothing about
the product (its weak null mixes the perturbed candidate into the baseline).

--real-retests N checks the resampled design against the real thing: N independent re-tests
of each candidate, each a whole `grpogate gate --candidate ADAPTER --train-from-config` run in
this process (one model load for all), with its own sampling seed and its own eval and guard
problems (seed, task.eval_seed and guard.seed all 1000 + k): the sequential re-test sampled
fresh and stopped where the rule stops, judged on every gate the decision has (retest_kl,
length_budget, isolation included) (bench/decision_real.py). Each outcome is appended to
DIR/real_retests.jsonl as it ends and not run again; the run directories stay in DIR/gates.
--perturbed SCALE adds a near-null candidate: the null adapter with seeded random B of that
scale, whose completions part from the baseline's while its true gain (its pool's) stays near
0; the null candidate is left out there (its completions are the baseline's, pair for pair).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decision_mixtures  # noqa: E402
import decision_resample  # noqa: E402
from grpogate.errors import InputError  # noqa: E402

POOL_KIND = "grpogate-decision-pool"
# None: the default's own population (task.eval_pool eval problems, guard.prompts guard ones).
FULL = {"eval_pool": None, "eval_samples": 8, "guard_pool": None, "guard_samples": 64,
        "draws": 2000}
QUICK = {"eval_pool": 8, "eval_samples": 4, "guard_pool": 3, "guard_samples": 8, "draws": 30}
QUICK_MIXTURES = ("0.5", "0:1:null")  # quick's first --candidate: the perturbed adapter
QUICK_OVERRIDES = ["eval_prompts=6", "eval_batch_prompts=2", "eval_group_size=2",
                   "task.eval_pool=16", "guard.prompts=3", "guard.group_size=2",
                   "guard.rounds=3", "max_new_tokens=8", "train_prompts=4",
                   "prompts_per_step=2", "group_size=4", "lora_r=4", "generation_batch_size=16",
                   "device=cpu", "dtype=float32"]


def tiny_model(directory: Path) -> Path:
    """A random 2-layer Llama (hidden size 64) with the bundled SmolLM2 tokenizer, built once
    into `directory`: the test suite's tiny model too (tests/conftest.py calls this)."""
    if (directory / "config.json").is_file():
        return directory
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from grpogate.config import BUNDLED_MODEL, RunConfig
    from grpogate.inputs.policy import default_cache_dir, resolve_base_model

    source = resolve_base_model(BUNDLED_MODEL, "", default_cache_dir(RunConfig()))
    tokenizer = AutoTokenizer.from_pretrained(source.load_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def study_config(quick: bool, work_dir: Path, model: str | None, overrides: tuple = ()):
    """The default profile's config (its re-test design and gates) with `overrides` (--set:
    another design, e.g. eval_prompts=384); --quick: tiny sizes on the tiny model."""
    from grpogate.config import load_config

    if quick:
        import torch

        torch.set_num_threads(1)  # the tiny model's kernels gain nothing from threads
        model = model or str(tiny_model(work_dir / "tiny-model"))
        return load_config("default", overrides=QUICK_OVERRIDES + list(overrides), model=model)
    return load_config("default", overrides=list(overrides), model=model)


def null_candidate(config, directory: Path) -> Path:
    """grpogate's fresh LoRA adapter (random A, B = 0) saved as a PEFT adapter: a distinct
    file and hash computing exactly the baseline's function (x W + s x B A x = x W)."""
    from grpogate.files.tensors import lora_b_all_zero
    from grpogate.inputs.policy import ADAPTER_WEIGHTS, load_policy, save_adapter

    weights = directory / ADAPTER_WEIGHTS
    if not weights.is_file():
        policy = load_policy(dataclasses.replace(config, adapter="", baseline_manifest=""),
                             seed=config.seed + 1)
        save_adapter(policy, directory)
    if not lora_b_all_zero(weights):
        raise SystemExit(f"error: {directory}: a LoRA B tensor is nonzero; not a null candidate")
    return directory


def perturbed_candidate(null_dir: Path, directory: Path, scale: float = 0.05) -> Path:
    """The null adapter with random B (seeded) of `scale`: a candidate whose function differs
    from the baseline's a little (--quick's non-degenerate candidate; --perturbed's
    near-null)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from grpogate.inputs.policy import ADAPTER_WEIGHTS

    if (directory / ADAPTER_WEIGHTS).is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(null_dir / "adapter_config.json", directory / "adapter_config.json")
    generator = torch.Generator().manual_seed(1)
    tensors = {name: (torch.randn(t.shape, generator=generator, dtype=t.dtype) * scale
                      if "lora_B" in name else t)
               for name, t in load_file(null_dir / ADAPTER_WEIGHTS).items()}
    save_file(tensors, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return directory


def pool_design(config, sizes: dict, exclude_run: str | None) -> dict:
    """What a pool depends on besides the policy: the pool sizes, the tasks, the sampling."""
    return {"eval_pool": sizes["eval_pool"], "eval_samples": sizes["eval_samples"],
            "guard_pool": sizes["guard_pool"], "guard_samples": sizes["guard_samples"],
            "task": dataclasses.asdict(config.task), "guard": dataclasses.asdict(config.guard),
            "seed": config.seed, "max_new_tokens": config.max_new_tokens,
            "temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k,
            "min_p": config.min_p, "max_prompt_tokens": config.max_prompt_tokens,
            "system_prompt": config.resolved_system_prompt(), "dtype": config.dtype,
            "exclude_run": exclude_run}


def pool_key(config, adapter: str, design: dict) -> str:
    """The cache key: the base model, the adapter weights' sha256 and the pool design."""
    from grpogate.files import sha256_path
    from grpogate.inputs.policy import ADAPTER_WEIGHTS

    identity = {"model": config.model, "adapter_sha256":
                sha256_path(Path(adapter) / ADAPTER_WEIGHTS) if adapter else None,
                "design": design}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def _set_configs(config, adapter: str, design: dict):
    """The eval pool's and the guard pool's configs: the run's, with the pool as the eval set
    (the guard pool: the guard task, its verifier and the run's system prompt)."""
    from grpogate.config import TaskConfig, validate

    base = dataclasses.replace(config, adapter=adapter, baseline_manifest="",
                               eval_prompts=design["eval_pool"],
                               eval_group_size=design["eval_samples"])
    # The guard's problems in generation order (eval_pool 0), as the run's guard set takes its
    # first guard.prompts.
    guard_task = TaskConfig(source="reasoning-gym", name=config.guard.task,
                            params=dict(config.guard.params), eval_seed=config.guard.seed,
                            eval_pool=0)
    guard = dataclasses.replace(base, task=guard_task, eval_prompts=design["guard_pool"],
                                eval_group_size=design["guard_samples"],
                                verifier=config.guard.verifier(),
                                system_prompt=config.resolved_system_prompt())
    return {"eval": validate(base), "guard": validate(guard)}


def generate_pool(config, name: str, adapter: str, design: dict) -> list[dict]:
    """The policy's pool as JSONL lines: a header, then one line per prompt and set with its
    samples' rewards, texts, token counts and truncation flags (in sample order)."""
    from grpogate.review.standalone_eval import evaluate_standalone
    from grpogate.seeding import eval_seed

    lines, header = [], {"kind": POOL_KIND, "policy": name, "design": design, "seconds": {}}
    for set_name, set_config in _set_configs(config, adapter, design).items():
        skip = design["exclude_run"] if set_name == "eval" else None
        document = evaluate_standalone(set_config, name, eval_seed(config.seed), skip_run=skip)
        header["identity"] = document["policy"]
        header["seconds"][set_name] = document["seconds"]["evaluation"]
        header.setdefault("completions", {})[set_name] = len(document["records"])
        by_prompt: dict[str, list[dict]] = {}
        for record in document["records"]:
            by_prompt.setdefault(record["prompt_id"], []).append(record)
        for prompt_id in document["prompt_ids"]:
            samples = sorted(by_prompt[prompt_id], key=lambda r: r["sample_index"])
            lines.append({"set": set_name, "prompt_id": prompt_id,
                          "rewards": [r["reward"] for r in samples],
                          "texts": [r["completion"] for r in samples],
                          "tokens": [r["completion_tokens"] for r in samples],
                          "hit": [r["hit_max_length"] for r in samples]})
    return [header, *lines]


def load_pool(config, name: str, adapter: str, design: dict, work_dir: Path) -> dict:
    """The policy's pool from DIR/pools/<key>.jsonl, generated and written first when absent;
    {"header", "eval", "guard"} with each set's prompt ids, rewards [P][S], texts, ..."""
    from grpogate.files import atomic_write_bytes, jsonl_bytes, read_jsonl

    path = work_dir / "pools" / f"{pool_key(config, adapter, design)}.jsonl"
    if not path.is_file():
        print(f"generating the pool of {name} ...", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, jsonl_bytes(generate_pool(config, name, adapter, design)))
    header, *lines = read_jsonl(path)
    if header.get("kind") != POOL_KIND or header.get("design") != design:
        raise SystemExit(f"error: {path}: not this study's pool (kind or design differs)")
    pool = {"header": header}
    for set_name in decision_resample.SETS:
        rows = [line for line in lines if line["set"] == set_name]
        pool[set_name] = {key: [row[field] for row in rows] for key, field in (
            ("prompt_ids", "prompt_id"), ("rewards", "rewards"), ("texts", "texts"),
            ("tokens", "tokens"), ("hit", "hit"))}
    return pool


def resolved_sizes(config, sizes: dict) -> dict:
    """The pool sizes with the default populations filled in (None: task.eval_pool eval problems,
    guard.prompts guard problems); a pool too small for the design is an InputError."""
    from grpogate.errors import InputError

    sizes = {**sizes, "eval_pool": sizes["eval_pool"] or config.task.eval_pool,
             "guard_pool": sizes["guard_pool"] or config.guard.prompts}
    if sizes["guard_pool"] < config.guard.prompts:
        raise InputError(f"--guard-pool {sizes['guard_pool']}: every guard round covers all "
                         f"guard.prompts = {config.guard.prompts} problems; use at least that")
    # The "self" null takes two disjoint groups of every prompt's and guard problem's samples.
    need = {"eval_pool": config.eval_prompts, "eval_samples": 2 * config.eval_group_size,
            "guard_samples": 2 * config.guard.group_size}
    for key, least in need.items():
        if sizes[key] < least:
            raise InputError(f"--{key.replace('_', '-')} {sizes[key]}: the design needs at "
                             f"least {least}")
    return sizes


def study(work_dir: Path, candidates: list[str], sizes: dict, seed: int, quick: bool,
          exclude_run: str | None, model: str | None, pools_only: bool = False,
          mixtures: tuple[str, ...] = (), overrides: tuple[str, ...] = (),
          rows: tuple[str, ...] = ()) -> dict:
    """Every policy's pool, then `draws` resampled re-tests of each candidate (none with
    `pools_only`: the pools and their generation rate alone). --quick's first candidate is the
    perturbed adapter, and its mixtures QUICK_MIXTURES when none are given."""
    config = study_config(quick, work_dir, model, overrides)
    sizes = resolved_sizes(config, sizes)
    design = pool_design(config, sizes, exclude_run)
    null_dir = null_candidate(config, work_dir / "null-candidate")
    named = [(f"candidate {path}", path) for path in candidates]
    if quick:
        named.insert(0, ("perturbed (quick)",
                         str(perturbed_candidate(null_dir, work_dir / "perturbed-candidate"))))
        mixtures = mixtures or QUICK_MIXTURES
    started = time.monotonic()
    baseline = load_pool(config, "baseline", "", design, work_dir)
    pools = [(name, load_pool(config, name, adapter, design, work_dir))
             for name, adapter in [("null candidate", str(null_dir)), *named]]
    generation_seconds = time.monotonic() - started
    settings = config.to_dict()
    if pools_only:
        return {"pools_only": True, "pool_design": design,
                "generation": generation_rates([baseline] + [pool for _, pool in pools])}
    try:  # graded policies and weak nulls from the --candidate pools (decision_mixtures)
        pools += [decision_mixtures.build(item, baseline, pools[1:], seed,
                                          config.gates.maximum_guard_reward_loss)
                  for item in mixtures]
    except ValueError as error:
        raise InputError(f"--mixtures {error}") from None
    drawn = [(decision_resample.SELF, baseline), *pools]
    if rows:  # --rows: these policies alone (the study split over processes)
        drawn = [(name, pool) for name, pool in drawn if name.startswith(rows)]
    results = [{"policy": name, "identity": pool["header"]["identity"],
                **decision_resample.study_policy(baseline, pool, settings, sizes["draws"], seed,
                                                 disjoint=name == decision_resample.SELF)}
               for name, pool in drawn]
    return {"quick": quick, "design": {
                **sizes, "eval_prompts": config.eval_prompts,
                "eval_batch_prompts": config.eval_batch_prompts,
                "eval_group_size": config.eval_group_size, "guard_prompts": config.guard.prompts,
                "guard_group_size": config.guard.group_size, "guard_rounds": config.guard.rounds},
            "pool_design": design, "gates": settings["gates"], "results": results,
            "generation": generation_rates([baseline] + [pool for _, pool in pools
                                                        if "seconds" in pool["header"]]),
            "seconds": {"pools": generation_seconds,
                        "resampling": time.monotonic() - started - generation_seconds}}


def generation_rates(pools: list[dict]) -> dict:
    """Completions per second of every pool generated (the cached ones carry theirs too)."""
    completions = sum(sum(p["header"]["completions"].values()) for p in pools)
    seconds = sum(sum(p["header"]["seconds"].values()) for p in pools)
    return {"completions": completions, "seconds": seconds,
            "completions_per_second": completions / seconds if seconds else None}


def _mixture_items(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The --mixtures items, each checked (decision_mixtures.parse); a bad one is a usage
    error. Policy numbers: --quick's perturbed candidate first, --perturbed's last."""
    mixtures = [item for item in args.mixtures.split(",") if item]
    if mixtures and args.real_retests:
        parser.error("--mixtures: not with --real-retests")
    for item in mixtures:
        try:
            decision_mixtures.parse(item, len(args.candidate) + args.quick
                                    + bool(args.perturbed))
        except ValueError as error:
            parser.error(f"--mixtures {error}")
    return mixtures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--candidate", action="append", default=[], metavar="ADAPTER_DIR")
    parser.add_argument("--baseline", default=None, metavar="MODEL",
                        help="the base model (default: the default profile's, the bundled one)")
    parser.add_argument("--exclude-run", default=None, metavar="RUN_DIR")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0, help="the resampler's seed")
    parser.add_argument("--pools-only", action="store_true",
                        help="generate (or read) the pools and state their rate; no resampling")
    parser.add_argument("--real-retests", type=int, default=0, metavar="N",
                        help="N real re-tests of each candidate (and --perturbed), fresh seeds")
    parser.add_argument("--mixtures", default="", metavar="ITEMS",
                        help="comma-separated graded policies: SHARE (the first --candidate "
                             "into the baseline), A:B:SHARE (policy B into policy A; 0 the "
                             "baseline, k the k-th --candidate), A:B:null (the weak null: "
                             "the share whose true reward gain is 0 +- 0.005) or A:B:guard "
                             "(the share whose true guard gain is -maximum_guard_reward_loss)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="a re-test design or gate other than the "
                        "default's (the pools do not depend on it), e.g. eval_prompts=384")
    parser.add_argument("--rows", default="", metavar="PARTS", help="comma-separated beginnings of "
                        "policy names: draw only the policies whose names begin with one (a study "
                        "split over processes; every pool is still read)")
    parser.add_argument("--perturbed", type=float, default=0.0, metavar="SCALE",
                        help="add the null adapter with random B of this scale as a candidate")
    for key in FULL:
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None)
    args = parser.parse_args(argv)
    mixtures = _mixture_items(parser, args)
    for adapter in args.candidate:  # one error line, before a model loads or a pool is made
        if not (Path(adapter) / "adapter_model.safetensors").is_file():
            parser.error(f"--candidate {adapter}: no adapter_model.safetensors there")
    sizes = {key: getattr(args, key) or (QUICK if args.quick else FULL)[key] for key in FULL}
    from grpogate.errors import visible

    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.quick and args.real_retests:
        args.baseline = args.baseline or str(tiny_model(args.work_dir / "tiny-model"))
    if args.perturbed:
        null_dir = null_candidate(study_config(args.quick, args.work_dir, args.baseline),
                                  args.work_dir / "null-candidate")
        args.candidate.append(str(perturbed_candidate(
            null_dir, args.work_dir / f"perturbed-{args.perturbed:g}", args.perturbed)))
    if args.real_retests:
        from decision_real import real_retests

        real = real_retests(args.work_dir, [(f"candidate {c}", c) for c in args.candidate],
                            args.real_retests, args.exclude_run, args.baseline, args.quick)
        (args.work_dir / "real_retests.json").write_text(json.dumps(real, indent=1) + "\n")
        print(json.dumps(real["results"], indent=1), flush=True)
        return
    try:
        result = study(args.work_dir, args.candidate, sizes, args.seed, args.quick,
                       args.exclude_run, args.baseline, args.pools_only,
                       tuple(mixtures), tuple(args.overrides),
                       tuple(part for part in args.rows.split(",") if part))
    except InputError as error:  # bad input: one error line, exit 2, no results written
        print(f"error: {visible(error)}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.pools_only:
        print(json.dumps(result["generation"]), flush=True)
        return
    table = decision_resample.markdown(result["results"], result["design"])
    (args.work_dir / "decision_quality.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.work_dir / "decision_quality.md").write_text(table)
    rate = result["generation"]["completions_per_second"]
    for line in table.splitlines():  # run-derived text (paths, names): control characters shown
        print(visible(line), flush=True)
    print(f"pools: {result['generation']['completions']} completions, "
          f"{rate if rate is None else round(rate, 2)} completions/s; resampling "
          f"{result['seconds']['resampling']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
