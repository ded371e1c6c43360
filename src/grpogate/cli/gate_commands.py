"""`grpogate gate --from-trl DIR | --candidate DIR`: parse, call trl_gate (or, with --dry-run,
gate_dry_run), print (cli/__init__.py registers it).

The printing is the run's own (`print_result`, handed in by cli/__init__.py): a gated run ends exactly
as a `grpogate run` does, with the gates table, the re-test line and the decision.
"""

from __future__ import annotations

from typing import Callable, Optional

import typer

from grpogate.cli.eval_commands import TASK_HELP
from grpogate.cli.plan import print_dry_run
from grpogate.config import load_config
from grpogate.errors import InputError
from grpogate.cli.terminal import RichReporter, console, fail, progress_bars


# The two doors (exactly one): a TRL run with its log, or a candidate from any trainer.
FROM_TRL = typer.Option("", "--from-trl", metavar="DIR", help="A TRL GRPOTrainer output_dir (or "
                        "one checkpoint-N/): adapter_config.json + adapter_model.safetensors "
                        "and trainer_state.json. Pickles are never loaded.")
CANDIDATE = typer.Option("", "--candidate", metavar="DIR", help="A candidate from any trainer, "
                         "without its log: a PEFT adapter folder (adapter_config.json + "
                         "adapter_model.safetensors) or a Hugging Face checkpoint (config.json + "
                         "model.safetensors, or shards with model.safetensors.index.json). "
                         "Pickles are never loaded.")
TRAIN_DATA = typer.Option(
    "", "--train-data", metavar="FILE", help="The training dataset as TRL took it, a local file "
    "or folder: .jsonl (read line by line), or parquet, .json, .csv, .arrow or a save_to_disk "
    "folder (read by Hugging Face datasets, every split). Each row's \"prompt\" (a string or "
    "chat messages) is what TRL trained on: no eval prompt may appear inside it.")


BASELINE = typer.Option(None, metavar="BASE[+ADAPTER]", help="The baseline the candidate was "
                        "trained from (default: the profile's model); an adapter's "
                        "base_model_name_or_path must name it, a checkpoint must be of its "
                        "architecture.")
TRL_ARGS = typer.Option("", "--trl-args", metavar="FILE", help="The run's GRPOConfig fields as "
                        "JSON (trainer.args.to_json_string()) or TOML.")
NUM_GENERATIONS = typer.Option(None, "--num-generations", metavar="G", min=1,
                               help="TRL's num_generations (G), unless --trl-args gives it.")
DRY_RUN = typer.Option(False, "--dry-run", help="Make every check the gate makes before it "
                       "samples and print its plan (the re-test's looks and what it resolves, "
                       "the gates); write nothing.")
AS_JSON = typer.Option(False, "--json", help="With --dry-run: print its report as JSON alone on "
                       "stdout (every message goes to stderr).")


def gate_command(print_result: Callable[[dict, bool], None]):
    def gate(
        from_trl: str = FROM_TRL,
        candidate: str = CANDIDATE,
        baseline: Optional[str] = BASELINE,
        trl_args: str = TRL_ARGS,
        num_generations: Optional[int] = NUM_GENERATIONS,
        train_data: str = TRAIN_DATA,
        train_from_config: bool = typer.Option(
            False, "--train-from-config", help="The run trained on the config's own train split."),
        profile: str = typer.Option("default", metavar="NAME", help="Packaged profile for the "
                                    "task, the re-test's sampling and the gates."),
        config_file: str = typer.Option("", "--config", metavar="FILE",
                                        help="TOML file applied on top of the profile."),
        gates_file: str = typer.Option("", "--gates", metavar="FILE",
                                       help="TOML or JSON file with one \\[gates] table."),
        overrides: list[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                            help="Override any config key."),
        task: Optional[str] = typer.Option(None, metavar="SOURCE:NAME", help=TASK_HELP),
        out: Optional[str] = typer.Option(None, metavar="DIR", help="Run directory (must not exist)."),
        label: Optional[str] = typer.Option(None, metavar="LABEL",
                                            help="Run label: outputs go to runs/LABEL."),
        device: Optional[str] = typer.Option(None, metavar="auto|cpu|cuda", help="Device."),
        dtype: Optional[str] = typer.Option(None, metavar="float32|bfloat16|auto",
                                            help="Base weights dtype."),
        exit_code_from_decision: bool = typer.Option(
            False, "--exit-code-from-decision", help="Exit 0 on accept, 3 on tune, 4 on reject."),
        dry_run: bool = DRY_RUN,
        as_json: bool = AS_JSON,
    ) -> None:
        """Gate a candidate trained elsewhere (a TRL run, or any trainer's adapter or
        checkpoint): admission, the paired re-test, the gates, a manifest."""
        from grpogate.review.standalone_eval import parse_policy_spec, parse_tasks_spec
        from grpogate.trl_gate import GateRequest, gate as gate_run

        try:
            if as_json and not dry_run:
                raise InputError("--json goes with --dry-run (a gated run's evidence is "
                                 "RUN_DIR/evidence.json; `grpogate decide RUN_DIR --json` "
                                 "prints its audit)")
            model, adapter = parse_policy_spec(baseline) if baseline else (None, None)
            config = load_config(profile, config_file, overrides, gates_file=gates_file, out=out,
                                 label=label, model=model, adapter=adapter, device=device,
                                 dtype=dtype, task=parse_tasks_spec(task) if task else None)
            request = GateRequest(from_trl, trl_args, num_generations, train_data,
                                  train_from_config, candidate)
            if dry_run:
                from grpogate.gate_dry_run import dry_run as gate_dry_run

                print_dry_run(gate_dry_run(config, request), as_json)
                return
            with progress_bars() as progress:
                evidence = gate_run(config, request, RichReporter(progress))
        except InputError as error:
            fail(error)
        _print_admission(evidence)
        print_result(evidence, exit_code_from_decision)

    return gate


def _print_admission(evidence: dict) -> None:
    """What only a gated candidate's admission says: its weights' finiteness, whether isolation
    was checked, where the rollout figures come from."""
    from grpogate.inputs.candidate_dir import finite_weights_line

    admission = evidence["foreign"]["admission"]
    console.print(finite_weights_line(admission["finite_weights"]), soft_wrap=True)
    if not admission["isolation"]["checked"]:
        console.print(f"[yellow]{admission['isolation']['note']}[/]", soft_wrap=True)
    console.print(f"rollout figures: {evidence['rollout']['source_note']}", soft_wrap=True)
