#!/usr/bin/env bash
# Run the kvproxy demo from a fresh clone: two calibrated simulated engines, the real
# router (smg, consistent hashing) and kvproxy, the W1 (swe) workload at twice the KV
# pool with kvproxy's features off and on (seed 0; --seeds for more): ratios to off, a
# verdict, results.json and a chart.
#
#   scripts/demo.sh            # about four minutes on 2 cores
#   scripts/demo.sh --quick    # a smaller KV-bound W1: about 30 s with 8+ cores (off and
#                              #   both side by side), about 50 s on 2 cores
#   scripts/demo.sh --lab      # the lab's policy table (virtual time)
#
# Creates .venv (if absent) and installs kvproxy with its lab extra into it.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
    echo "creating .venv with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c 'import kvproxy, matplotlib, smg' >/dev/null 2>&1; then
    echo "installing kvproxy[lab] into .venv"
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[lab]'
fi
exec .venv/bin/kvproxy demo "$@"
