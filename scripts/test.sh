#!/usr/bin/env bash
# Runs the whole test suite (setting the machine up first if needed), then type-checks, lints and
# checks the formatting.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
.venv/bin/python -m mypy
.venv/bin/ruff check krex_async tests bench scripts
.venv/bin/ruff format --check krex_async tests bench scripts
