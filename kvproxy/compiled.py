"""Which of the request path's modules run compiled.

``KVPROXY_COMPILE=1 pip install .`` builds the modules below with mypyc (``setup.py``
reads this list): the pure core a request goes through (the body scan, the plan, the
session table, admission's decision and ledger) and the handlers that call it. The
source is the same; mypyc turns each typed function into C, and a feature's share of
a request runs in 27-47 % fewer instructions and about half the CPU time (measured side
by side with the Python build on a quiet host: docs/benchmarks.md, "Where the targets
stand on a quiet host"). A plain ``pip install .`` runs the same modules as Python: that
is the default (no compiler needed) and the reference, and what the tests run first.

Nothing here imports the modules it names, so ``setup.py`` can read it at build time.
"""

from __future__ import annotations

import importlib.machinery
import sys
from collections.abc import Mapping

# The request path, in dependency order. A module that subclasses one of these, or is
# subclassed by Python code (a test's subclass included), must not be added: a compiled
# class cannot be subclassed from Python.
MODULES: tuple[str, ...] = (
    "kvproxy.record",
    "kvproxy.vocab",
    "kvproxy.observability",
    "kvproxy.proxy.errors",
    "kvproxy.proxy.body",
    "kvproxy.proxy.scan",
    "kvproxy.sessions.identity",
    "kvproxy.dynamo.nvext",
    "kvproxy.sessions.table",
    "kvproxy.proxy.pipeline",
    "kvproxy.admission.transitions",
    "kvproxy.admission.program.events",
    "kvproxy.admission.records",
    "kvproxy.admission.classify",
    "kvproxy.admission.program.priority",
    "kvproxy.admission.reservation",
    "kvproxy.admission.program.queues",
    "kvproxy.admission.fleet.ledger",
    "kvproxy.admission.fleet.queue",
    "kvproxy.admission.program.session",
    "kvproxy.admission.program.ledger",
    "kvproxy.replication.ledger",  # (subclasses the program ledger's and session's classes)
    "kvproxy.admission.program.core",
    "kvproxy.admission.learning",
    "kvproxy.admission.waiters",
    "kvproxy.admission.gate",
    "kvproxy.admission.fleet.gate",
    "kvproxy.admission.program.gate",
    "kvproxy.admission.wiring",
    "kvproxy.admission.view",
    "kvproxy.admission.controls",
    "kvproxy.admission.coordinator",
    "kvproxy.dynamo.streaming",
    "kvproxy.sessions.lifecycle_core",
    "kvproxy.sessions.lifecycle_metrics",
    "kvproxy.sessions.tracked",
    "kvproxy.sessions.lifecycle",
    "kvproxy.proxy.usage",
    "kvproxy.proxy.turn",
    "kvproxy.headers",
    "kvproxy.proxy.upstream",
    "kvproxy.proxy.responses",
    "kvproxy.dynamo.relay",
    "kvproxy.proxy.dynamo_layer",
    "kvproxy.proxy.handlers",
)

# The build switch: KVPROXY_COMPILE=1 (``setup.py`` and the build backend read it).
COMPILE_ENV = "KVPROXY_COMPILE"


def compile_requested(environ: Mapping[str, str]) -> bool:
    """Whether the build should compile :data:`MODULES` (``1``, ``true`` or ``yes``)."""
    return environ.get(COMPILE_ENV, "").strip().lower() in {"1", "true", "yes"}


def compiled_modules() -> tuple[str, ...]:
    """The modules of :data:`MODULES` that are loaded as compiled extensions now (a
    module not imported yet is imported: the answer is about what a request runs)."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    found = []
    for name in MODULES:
        module = sys.modules.get(name) or importlib.import_module(name)
        if str(getattr(module, "__file__", "") or "").endswith(suffixes):
            found.append(name)
    return tuple(found)


def build_name(found: tuple[str, ...]) -> str:
    """The build as the start-up line names it, from :func:`compiled_modules`."""
    if found == MODULES:
        return "compiled"
    if not found:
        return "python"
    return f"mixed ({len(found)} of {len(MODULES)} compiled)"
