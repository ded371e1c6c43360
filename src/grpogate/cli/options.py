"""The options of `grpogate run` and `grpogate decide`, declared here so that each command
(cli/__init__.py) reads as its list of options; typer takes each from the command's signature."""

from __future__ import annotations

import typer

from grpogate.cli.eval_commands import TASK_HELP
from grpogate.config import RunConfig

# Every default `run --help` shows is the default profile's value, read from the schema (the
# one place a setting's default is written); a profile or --config changes it.
DEFAULTS = RunConfig()
NONE = "none"


def default(value) -> str:
    """" [default: VALUE]" for the end of an option's help (escaped: not rich markup)."""
    return f" \\[default: {value}]"


# grpogate run: where the configuration comes from and where the run goes.
PROFILE = typer.Option(None, metavar="NAME", help="Packaged profile: default, smoke, "
                       "gsm8k_qwen05b." + default("default"))
CONFIG_FILE = typer.Option("", "--config", metavar="FILE",
                           help="TOML file applied on top of the profile." + default(NONE))
GATES_FILE = typer.Option("", "--gates", metavar="FILE",
                          help="TOML or JSON file with one \\[gates] table, applied on top of "
                          "--config." + default(NONE))
OVERRIDES = typer.Option([], "--set", metavar="KEY=VALUE",
                         help="Override any config key, e.g. task.params.max_digits=3 (grpogate "
                         "config show lists them; TRL's names such as num_generations are "
                         "taken too)." + default(NONE))
OUT = typer.Option(None, metavar="DIR",
                   help="Run directory (must not exist)." + default("runs/LABEL"))
LABEL = typer.Option(None, metavar="LABEL", help="Run label: outputs go to runs/LABEL."
                     + default("PROFILE-DATE-TIME"))

# The settings people change most, as flags (each is also a config key).
MODEL = typer.Option(None, metavar="MODEL", help="Base model: bundled id, HF model directory, "
                     ".gguf file or HF id." + default(DEFAULTS.model))
ADAPTER = typer.Option(None, metavar="DIR", help="Baseline LoRA adapter directory (PEFT, "
                       "safetensors) to start from." + default(NONE))
TASK = typer.Option(None, metavar="SOURCE:NAME",
                    help=TASK_HELP + default(f"{DEFAULTS.task.source}:{DEFAULTS.task.name}"))
STEPS = typer.Option(None, metavar="N", help="Training steps (sets train_prompts = N x "
                     "prompts_per_step)." + default(DEFAULTS.steps))
GROUP_SIZE = typer.Option(None, metavar="G", help="Completions sampled per prompt (TRL's "
                          "num_generations)." + default(DEFAULTS.group_size))
LEARNING_RATE = typer.Option(None, "--lr", metavar="LR", help="AdamW learning rate of the LoRA "
                             "weights." + default(DEFAULTS.learning_rate))
MAX_NEW_TOKENS = typer.Option(None, metavar="N", help="Completion token budget (TRL's "
                              "max_completion_length)." + default(DEFAULTS.max_new_tokens))
BASELINE_MANIFEST = typer.Option(None, metavar="FILE", help="An accepted run's manifest.json "
                                 "to start from." + default(NONE))
SEED = typer.Option(None, metavar="N", help="Run seed." + default(DEFAULTS.seed))
DEVICE = typer.Option(None, metavar="auto|cpu|cuda", help="Device (auto: cuda when torch sees "
                      "a GPU, else cpu)." + default(DEFAULTS.device))
DTYPE = typer.Option(None, metavar="float32|bfloat16|auto", help="Base weights dtype (auto: "
                     "bfloat16 where the hardware computes it natively, else float32)."
                     + default(DEFAULTS.dtype))
REPORT_TO = typer.Option(None, "--report-to", metavar="NAMES",
                         help="Also log per-step scalars, the decision and gains to trackers: "
                         "tensorboard, mlflow, wandb, trackio (comma-separated)." + default(NONE))
TENSORBOARD = typer.Option(None, "--tensorboard", metavar="DIR",
                           help="Write the TensorBoard event files into DIR (implies --report-to "
                           "tensorboard)." + default(NONE))

# How the command runs.
DRY_RUN = typer.Option(False, "--dry-run", help="Check config, inputs and environment only."
                       + default("off"))
DRY_RUN_JSON = typer.Option(False, "--json", help="With --dry-run: print its report as JSON "
                            "alone on stdout (every message goes to stderr)." + default("off"))
RESUME = typer.Option(None, "--resume", metavar="RUN_DIR",
                      help="Continue the run in this directory from its last checkpoint, with its "
                      "stored config (other options may only repeat it)." + default(NONE))
EXIT_CODE_FROM_DECISION = typer.Option(False, "--exit-code-from-decision",
                                       help="Exit 0 on accept, 3 on tune, 4 on reject."
                                       + default("off: 0 whatever the decision"))
NPROC = typer.Option(None, "--nproc", metavar="N", min=1,
                     help="Launch the run on N processes on this machine under torch's elastic "
                     "agent (as torchrun --standalone --nproc_per_node N -m grpogate run ...); a "
                     "worker that dies is one error line, its traceback in a log file."
                     + default("one process, no agent"))
MAX_RESTARTS = typer.Option(0, "--max-restarts", metavar="K", min=0,
                            help="With --nproc: torchrun restarts a failed worker group up to K "
                            "times; the restarted group resumes from the last checkpoint.")

# grpogate decide
RUN_DIR = typer.Argument(..., metavar="RUN_DIR",
                         help="A finished run directory (evidence.json, manifest.json).")
AS_JSON = typer.Option(False, "--json", help="Print the full audit as JSON.")
REPLAY = typer.Option(0, "--replay", metavar="N", min=0,
                      help="Also regenerate the re-test completions of the first N eval prompts "
                      "(both policies) from the delivered artifacts and require them to equal the "
                      "stored ones (loads the model).")
VERIFY_KEY = typer.Option(None, "--verify-key", metavar="PUB",
                          help="Also verify RUN_DIR/run.sig (grpogate sign) with this PEM public "
                          "key.")
TRUST_REWARD_CODE = typer.Option(
    [], "--trust-reward-code", metavar="MODULE:FUNCTION",
    help="Re-score this user reward by importing and running it (it must be importable here, "
    "outside RUN_DIR, and its source must hash to the version the run recorded). Without it a "
    "user reward's values are taken as recorded: decide never runs code a run directory names. "
    "Repeat for several.")
MAX_RESCORE = typer.Option(None, "--max-rescore", metavar="N", min=0,
                           help="Re-run the verifier (and trusted reward code) on a random sample "
                           "of N records only; the others' values are taken as recorded (the "
                           "seed is printed).")
