#!/usr/bin/env bash
# Build kvproxy's wheel and check that it installs and runs outside this checkout:
#   - the build prints no setuptools warning (licence metadata in the current form);
#   - in a fresh virtualenv, from a directory outside the checkout, `kvproxy --version`
#     and `kvproxy serve --help` work and the installed package (not the checkout) is used;
#   - the tools' package kvlab is in the wheel too, with its packaged trace, and the tools'
#     commands (`kvproxy sim-engine | workload | lab`, `python -m kvproxy.workload`) load;
#   - `kvproxy serve` from that install serves the dashboard and its static files.
# Fast: the fresh venv gets no pip of its own (the checkout's pip installs into it) and
# reuses the dependencies already in .venv through a .pth line (they are not reinstalled),
# so only the wheel itself is installed. Needs .venv (scripts/test.sh creates it).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
source scripts/fresh_venv.sh
VENV_PY="$REPO/.venv/bin/python"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvproxy-wheel.XXXXXX")"
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

fail() { echo "check_wheel: FAIL: $*" >&2; exit 1; }

# 1. Build (pip's isolated build env, pip's cache); the build log is kept for the scan.
"$VENV_PY" -m pip wheel --no-deps --verbose --wheel-dir "$WORK/dist" . >"$WORK/build.log" 2>&1 \
    || { tail -40 "$WORK/build.log" >&2; fail "the wheel did not build"; }
WHEEL="$(ls "$WORK"/dist/kvproxy-*.whl)"
if grep -Ei "SetuptoolsDeprecationWarning|SetuptoolsWarning|license.*deprecated" "$WORK/build.log" >&2; then
    fail "the build printed setuptools warnings (above)"
fi

# 2. A fresh venv without pip, seeing .venv's dependencies but not its kvproxy.
FRESH_SITE="$(fresh_venv_with_wheel "$VENV_PY" "$WHEEL" "$WORK")" || fail "the wheel did not install"

# 3. Run it from outside the checkout.
cd "$WORK"
version="$("$WORK/venv/bin/kvproxy" --version)" || fail "kvproxy --version exited $?"
expected="kvproxy $("$WORK/venv/bin/python" -c 'import kvproxy; print(kvproxy.__version__)')"
[ "$version" = "$expected" ] || fail "kvproxy --version printed '$version', expected '$expected'"
"$WORK/venv/bin/kvproxy" serve --help | grep -q -- "--router-url" || fail "kvproxy serve --help"
"$WORK/venv/bin/kvproxy" sim-engine --help | grep -q -- "--max-total-tokens" || fail "kvproxy sim-engine --help"
"$WORK/venv/bin/kvproxy" workload --help | grep -q -- "--base-url" || fail "kvproxy workload --help"
"$WORK/venv/bin/kvproxy" lab --help | grep -q -- "--policy" || fail "kvproxy lab --help"
"$WORK/venv/bin/python" -m kvproxy.workload --help | grep -q -- "--base-url" \
    || fail "python -m kvproxy.workload --help"
"$WORK/venv/bin/python" - "$FRESH_SITE" <<'PY' || fail "the installed package is incomplete"
import sys
from importlib import resources
from pathlib import Path

import kvlab
import kvproxy

site = Path(sys.argv[1]).resolve()
for package in (kvproxy, kvlab):
    where = Path(package.__file__).resolve()
    assert site in where.parents, f"{package.__name__} imported from {where}, not the wheel in {site}"
trace = resources.files("kvlab.workload").joinpath("traces", "sample.jsonl")
assert trace.is_file(), "kvlab/workload/traces/sample.jsonl missing from the wheel"
static = resources.files("kvproxy.admin").joinpath("static")
names = sorted(p.name for p in static.iterdir())
for needed in ("dashboard.html", "dashboard.js", "dashboard.css", "sign-in.html"):
    assert needed in names, f"{needed} missing from the wheel's kvproxy/admin/static ({names})"
PY

port="$("$WORK/venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
"$WORK/venv/bin/kvproxy" serve --host 127.0.0.1 --port "$port" --router-url http://127.0.0.1:9 \
    >"$WORK/serve.log" 2>&1 &
SERVER_PID=$!
"$WORK/venv/bin/python" - "$port" <<'PY' || { cat "$WORK/serve.log" >&2; fail "the installed kvproxy did not serve its dashboard"; }
import sys
import time
import urllib.error
import urllib.request

base = f"http://127.0.0.1:{sys.argv[1]}"
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
deadline = time.monotonic() + 20
for _ in range(400):
    try:
        with opener.open(base + "/kvproxy/health", timeout=2) as resp:
            if resp.status == 200:
                break
    except (urllib.error.URLError, OSError):
        pass
    if time.monotonic() > deadline:
        sys.exit("kvproxy serve did not answer /kvproxy/health within 20 s")
    time.sleep(0.05)
for path, needle in (
    ("/kvproxy/dashboard", b"<html"),
    ("/kvproxy/dashboard/static/dashboard.js", b"function"),
    ("/kvproxy/dashboard/static/dashboard.css", b"{"),
):
    with opener.open(base + path, timeout=5) as resp:
        body = resp.read()
        assert resp.status == 200 and needle in body, (path, resp.status, body[:200])
PY
kill "$SERVER_PID"
wait "$SERVER_PID" 2>/dev/null || true
SERVER_PID=""
echo "check_wheel: ok: $(basename "$WHEEL") installs, runs ($version) and serves its dashboard"
