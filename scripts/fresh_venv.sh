# Sourced by check_wheel.sh and check_compiled.sh: install a built wheel in a fresh
# virtualenv that sees .venv's dependencies (through a .pth line, not reinstalled) but
# not its kvproxy, and has no pip of its own (.venv's pip installs into it).
#
#   fresh_venv_with_wheel VENV_PY WHEEL DIR    # the venv at DIR/venv; prints its site dir
#   base_python VENV_PY                        # prints the interpreter VENV_PY's venv is of
base_python() {
    "$1" -c 'import sys; print(sys._base_executable)'
}

fresh_venv_with_wheel() {
    local venv_py="$1" wheel="$2" dir="$3" base fresh_site deps_site
    base="$(base_python "$venv_py")"
    "$base" -m venv --without-pip "$dir/venv"
    fresh_site="$("$dir/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    deps_site="$("$venv_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$deps_site" >"$fresh_site/kvproxy-check-deps.pth"
    "$venv_py" -m pip --python "$dir/venv/bin/python" install --quiet --no-deps --no-index "$wheel" >&2 \
        || return 1
    echo "$fresh_site"
}
