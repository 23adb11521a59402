#!/usr/bin/env bash
# Find (or install) a Chromium for the dashboard's browser tests; print its path.
#
# Order: $KVPROXY_CHROMIUM; chromium, chromium-browser, google-chrome-stable or
# google-chrome on PATH; else Debian's `chromium` package through apt-get when running as
# root or with passwordless sudo. When none of that works it prints one line on stderr
# saying what to install, prints nothing on stdout, and still exits 0 (the other tests
# can run; the browser tests then fail saying the same).
set -euo pipefail

find_chromium() {
    local name
    if [ -n "${KVPROXY_CHROMIUM:-}" ]; then
        echo "$KVPROXY_CHROMIUM"
        return 0
    fi
    for name in chromium chromium-browser google-chrome-stable google-chrome; do
        if command -v "$name" >/dev/null 2>&1; then
            command -v "$name"
            return 0
        fi
    done
    return 1
}

if find_chromium; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
        SUDO="sudo -n"
    fi
fi
if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; }; then
    echo "installing chromium (apt-get) for the dashboard's browser tests" >&2
    export DEBIAN_FRONTEND=noninteractive
    if $SUDO apt-get update -q >&2 \
        && $SUDO apt-get install -y -q --no-install-recommends chromium >&2 \
        && find_chromium; then
        exit 0
    fi
fi
echo "no Chromium for the dashboard's browser tests and no root to install it: run 'sudo apt-get install chromium' (Debian/Ubuntu), or set KVPROXY_CHROMIUM to an existing Chromium or Chrome binary" >&2
