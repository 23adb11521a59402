#!/usr/bin/env bash
# Run the kvproxy demo from a fresh clone: two simulated engines, the real router
# (smg) and kvproxy, the agentic workload four ways, a table, results.json and a chart.
#
#   scripts/demo.sh            # about two minutes
#   scripts/demo.sh --quick    # about 20 seconds
#
# Creates .venv (if absent) and installs kvproxy with its demo extra into it.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
    echo "creating .venv with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c 'import kvproxy, matplotlib, smg' >/dev/null 2>&1; then
    echo "installing kvproxy[demo] into .venv"
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[demo]'
fi
exec .venv/bin/kvproxy demo "$@"
