#!/usr/bin/env bash
# The one command that passes the tests, on a fresh clone too (.ci/run runs exactly this):
#   1. creates .venv if needed and installs kvproxy with its test extra (pytest,
#      pytest-aiohttp, ruff, playwright and smg, the real router), at the versions pinned
#      in constraints.txt, then audits them for known vulnerabilities
#      (scripts/audit_deps.py: pip-audit in a virtualenv of its own; a known
#      vulnerability fails, an unreachable vulnerability service is said in one line);
#   2. makes sure a Chromium is there for the dashboard's browser tests
#      (scripts/ensure_chromium.sh: KVPROXY_CHROMIUM, one on PATH, or Debian's package
#      when it can install it); otherwise it says in one line what to install, goes on;
#   3. makes sure redis-server and nginx are there for the multi-replica tests
#      (scripts/ensure_servers.sh: Debian's packages when it can install them;
#      otherwise one line saying what to install, and those tests fail);
#   4. lints (ruff check with the complexity cap, ruff format --check), type-checks
#      the package (mypy, configured in pyproject.toml) and runs pytest (arguments go
#      to pytest);
#   5. builds the wheel and checks it installs and runs in a fresh virtualenv
#      (scripts/check_wheel.sh), then builds the compiled one (KVPROXY_COMPILE=1) and
#      runs the unit and request-path tests on it (scripts/check_compiled.sh); both
#      skipped when pytest gets arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# The checkout's own install and wheel are the pure-Python build; check_compiled.sh
# builds the compiled one itself.
unset KVPROXY_COMPILE

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints.txt -e '.[test]'
"$PYTHON" scripts/audit_deps.py --python .venv/bin/python

# Chromium for the dashboard's browser tests (Playwright never downloads one).
KVPROXY_CHROMIUM="$(bash scripts/ensure_chromium.sh)"
if [ -n "$KVPROXY_CHROMIUM" ]; then export KVPROXY_CHROMIUM; else unset KVPROXY_CHROMIUM; fi

# redis-server and nginx for the multi-replica tests (they fail, not skip, without them).
bash scripts/ensure_servers.sh

.venv/bin/ruff check kvproxy kvlab tests scripts
.venv/bin/ruff format --check kvproxy kvlab tests scripts
.venv/bin/mypy
KVPROXY_EXPECT_COMPILED="${KVPROXY_EXPECT_COMPILED:-0}" .venv/bin/python -m pytest -q "$@"
if [ "$#" -eq 0 ]; then
    bash scripts/check_wheel.sh
    bash scripts/check_compiled.sh
fi
