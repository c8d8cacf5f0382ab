#!/usr/bin/env bash
# Sets up a fresh machine for krex: a venv in .venv with the package and its test dependencies, and,
# as root on Debian, bcc (eBPF) with kernel headers linked for the running kernel. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e '.[test]'
if [ -x .ci/install-bcc.sh ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  .ci/install-bcc.sh "$PWD/.venv" || echo "setup: bcc could not be installed; probe tests will skip" >&2
fi
echo "setup: ready (.venv/bin/krex)"
