#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, the real-SmolLM2 smoke run included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest "$@"
