#!/usr/bin/env bash
# Sets up a fresh machine for krex's first hour: a venv in .venv with the package and what the demo
# and a daemon need (the NVIDIA management library's bindings included: a few hundred kB). Nothing
# for the tests: scripts/test.sh adds their extras (Ray, mypy, matplotlib, ...) and, as root on
# Debian, bcc for the eBPF probes. Idempotent. PYTHON=/path/to/python3 picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e '.[nvidia]'
echo "setup: ready (.venv/bin/krex)"
