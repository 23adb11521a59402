"""kvproxy's build: pure Python by default; ``KVPROXY_COMPILE=1`` compiles the request
path with mypyc (the modules named in ``kvproxy/compiled.py``). Everything else about
the package is in ``pyproject.toml``."""

from __future__ import annotations

import os
import runpy
import shutil
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
# Read without importing the package (the build has none of its dependencies).
_compiled = runpy.run_path(str(HERE / "kvproxy" / "compiled.py"))

# A wheel is packed from what setuptools staged in build/lib*, which an earlier build of
# the checkout may have left: a compiled module the current build does not make (the
# module list changed) would be packed too, and its import fails. Staged afresh.
for _staged in (HERE / "build").glob("lib*"):
    shutil.rmtree(_staged, ignore_errors=True)

if _compiled["compile_requested"](os.environ):
    from mypyc.build import mypycify

    sources = [name.replace(".", "/") + ".py" for name in _compiled["MODULES"]]
    # pyproject.toml's [tool.mypy] applies; its overrides for modules outside this set
    # are unused here, which is not an error.
    options = ["--no-warn-unused-configs"]
    # One shared library for the group (the modules call each other natively), its C
    # in a file per module so that the compiler runs on every core.
    modules = mypycify(
        [*options, *sources], opt_level="3", group_name="kvproxy_core", multi_file=True
    )
    setup(ext_modules=modules, options={"build_ext": {"parallel": os.cpu_count() or 1}})
else:
    setup()
