#!/usr/bin/env bash
# Runs the whole test suite (setting the machine up first: scripts/setup.sh, then the test extras and,
# as root on Debian, bcc for the eBPF probes), then type-checks, lints and checks the formatting.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python -m pip install -q -e '.[test]'
if [ -x .ci/install-bcc.sh ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  .ci/install-bcc.sh "$PWD/.venv" || echo "test: bcc could not be installed; probe tests will skip" >&2
fi
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
.venv/bin/python -m mypy
.venv/bin/ruff check krex_async tests bench scripts
.venv/bin/ruff format --check krex_async tests bench scripts
