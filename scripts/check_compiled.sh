#!/usr/bin/env bash
# Build kvproxy with its request path compiled (KVPROXY_COMPILE=1: mypyc, see
# kvproxy/compiled.py) and run, on that build, the unit tests and the real-stack tests
# of the request path:
#   - the wheel builds as `KVPROXY_COMPILE=1 pip install .` builds it in a fresh
#     virtualenv: by a bare virtualenv's pip, none of kvproxy's dependencies installed
#     (pip's isolated build env fetches mypy and what it type-checks against), and
#     carries every module of kvproxy.compiled.MODULES as an extension;
#   - in a fresh virtualenv that sees .venv's dependencies but not its kvproxy, pytest
#     imports the installed build (-P and --import-mode=append keep the checkout's
#     source off the front of sys.path) with KVPROXY_EXPECT_COMPILED=1, so that
#     tests/unit/test_compiled.py fails unless the compiled modules are what ran.
# Needs .venv (scripts/test.sh creates it) and a C compiler. Arguments go to pytest in
# place of the default test selection.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
source scripts/fresh_venv.sh
VENV_PY="$REPO/.venv/bin/python"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvproxy-compiled.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

fail() { echo "check_compiled: FAIL: $*" >&2; exit 1; }

"$(base_python "$VENV_PY")" -m venv "$WORK/bare" || fail "no virtualenv to build in"
KVPROXY_COMPILE=1 "$WORK/bare/bin/python" -m pip wheel --no-deps --wheel-dir "$WORK/dist" . \
    >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log" >&2; fail "the compiled wheel did not build"; }
WHEEL="$(ls "$WORK"/dist/kvproxy-*.whl)"

fresh_venv_with_wheel "$VENV_PY" "$WHEEL" "$WORK" >/dev/null || fail "the compiled wheel did not install"

if [ "$#" -eq 0 ]; then
    set -- tests/unit \
        tests/integration/test_proxy_e2e.py tests/integration/test_lifecycle_e2e.py \
        tests/integration/test_admission_e2e.py tests/integration/test_program_e2e.py \
        tests/integration/test_dynamo_e2e.py tests/integration/test_big_responses.py \
        tests/integration/test_slow_clients.py tests/integration/test_lab_agreement.py \
        tests/integration/test_startup_log.py
fi
KVPROXY_EXPECT_COMPILED=1 "$WORK/venv/bin/python" -P -m pytest -q -p no:cacheprovider \
    --import-mode=append "$@" || fail "the tests failed on the compiled build"
echo "check_compiled: ok: $(basename "$WHEEL") (request path compiled) passes the tests above"
