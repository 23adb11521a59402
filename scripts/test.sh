#!/usr/bin/env bash
# The README's test command: creates .venv if needed, installs kvproxy with its test
# extra (pytest, pytest-aiohttp, ruff and smg, the real router), lints, runs the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[test]'
.venv/bin/ruff check kvproxy tests scripts
exec .venv/bin/python -m pytest -q "$@"
