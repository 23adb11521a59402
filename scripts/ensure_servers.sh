#!/usr/bin/env bash
# Make sure redis-server and nginx are installed for the multi-replica tests (the shared
# state's store and the round-robin load balancer in front of the replicas).
#
# Each one missing is installed from Debian's package of the same name through apt-get
# when running as root or with passwordless sudo. When that cannot be done it prints one
# line on stderr saying what to install and still exits 0: the other tests run, and the
# tests that need the server fail (never skip) saying the same.
set -euo pipefail

missing=()
for name in redis-server nginx; do
    if ! command -v "$name" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$name" ] && [ ! -x "/usr/bin/$name" ]; then
        missing+=("$name")
    fi
done
if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
        SUDO="sudo -n"
    fi
fi
if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; }; then
    echo "installing ${missing[*]} (apt-get) for the multi-replica tests" >&2
    export DEBIAN_FRONTEND=noninteractive
    # Debian would start the packaged services (nginx on port 80 of every address): a
    # policy-rc.d that refuses every start keeps them stopped; the tests start their own
    # on 127.0.0.1 and free ports. Removed again unless one was already there.
    policy=/usr/sbin/policy-rc.d
    made_policy=""
    if [ ! -e "$policy" ]; then
        $SUDO sh -c "printf '#!/bin/sh\nexit 101\n' > $policy && chmod +x $policy" && made_policy=1
    fi
    ok=""
    if $SUDO apt-get update -q >&2 \
        && $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >&2; then
        ok=1
    fi
    if [ -n "$made_policy" ]; then $SUDO rm -f "$policy"; fi
    if [ -n "$ok" ]; then exit 0; fi
fi
echo "no ${missing[*]} for the multi-replica tests and no root to install them: run 'sudo apt-get install ${missing[*]}' (Debian/Ubuntu); those tests fail until then" >&2
