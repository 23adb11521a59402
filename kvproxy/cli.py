"""Command line: ``kvproxy serve | doctor``, and the tools ``sim-engine | workload | lab | demo``.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
Only the module of the command being run is imported, so ``kvproxy sim-engine`` never
loads the proxy and ``kvproxy serve`` never loads the simulator or the demo.

The tools live in the top-level package ``kvlab`` (same distribution); what they need
beyond the proxy comes with the ``lab`` extra. This module is the one place in kvproxy
that reaches kvlab (by name, lazily); when kvlab or a module of the extra is missing,
a tool's command says in one line what to install and exits non-zero.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvproxy.serve", "run the proxy in front of sgl-router / smg"),
    "sim-engine": ("kvlab.sim.cli", "run a simulated SGLang engine (no GPU needed)"),
    "workload": (
        "kvlab.workload.driver",
        "run an agentic workload (preset or trace) against a URL",
    ),
    "demo": (
        "kvlab.demo",
        "W1 through the real stack, features off vs on, with verdicts (--lab: lab table)",
    ),
    "doctor": ("kvproxy.doctor.cli", "check a live deployment: router, engines' flags, config"),
    "lab": ("kvlab.lab.cli", "run engines, router, kvproxy and a workload in virtual time"),
}

# One example per command for ``--help`` (a module's own ``EXAMPLE`` is used when a
# command is missing here).
EXAMPLES: dict[str, str] = {
    "serve": "kvproxy serve --config configs/kvproxy.yaml --router-url http://127.0.0.1:30000",
    "sim-engine": "kvproxy sim-engine --port 31001 --max-total-tokens 200000 "
    "--mode session-radix --eviction-policy priority",
    "demo": "kvproxy demo --quick",
    "doctor": "kvproxy doctor --router-url http://127.0.0.1:30000 --config configs/kvproxy.yaml",
    "workload": "kvproxy workload --base-url http://127.0.0.1:8100 --workload swe --sessions 32",
    "lab": "kvproxy lab --workload swe --engines 2 --policy both",
}


# The tools' package and the top-level modules of the ``lab`` extra (pyproject.toml).
LAB_MODULES = frozenset({"kvlab", "matplotlib", "smg"})
LAB_INSTALL = "pip install 'kvproxy[lab]'"


def lab_module_missing(exc: ModuleNotFoundError) -> str | None:
    """The top-level name of the missing module when it is kvlab or part of the ``lab``
    extra, else None (any other missing module is a real error, raised as it is)."""
    top = (exc.name or "").partition(".")[0]
    return top if top in LAB_MODULES else None


def missing_lab_message(command: str, missing: str) -> str:
    """The one line a tool's command prints when ``missing`` is not installed."""
    return (
        f"kvproxy {command}: {missing!r} is not installed; "
        f"the tools need the lab extra: {LAB_INSTALL}"
    )


def load_command(command: str) -> ModuleType:
    """The module of ``command``; a tool whose package or extra is missing exits with
    :func:`missing_lab_message` (``SystemExit``: the line on stderr, status 1)."""
    name = SUBCOMMANDS[command][0]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = lab_module_missing(exc)
        if missing is None or name.partition(".")[0] != "kvlab":
            raise
        raise SystemExit(missing_lab_message(command, missing)) from None


def run_command(command: str, args: argparse.Namespace) -> int:
    """Run ``command``'s module on ``args`` (a tool that imports a missing part of the
    extra while it runs exits as :func:`load_command` does)."""
    module = load_command(command)
    try:
        return int(module.run(args) or 0)
    except ModuleNotFoundError as exc:
        missing = lab_module_missing(exc)
        if missing is None or not module.__name__.startswith("kvlab."):
            raise
        raise SystemExit(missing_lab_message(command, missing)) from None


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' layout and appends ``(default: X)`` where a default is set
    and the help text does not already state it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and "default" not in text
            and default not in (None, False, argparse.SUPPRESS)
            and action.nargs != 0
        ):
            text += " (default: %(default)s)"
        return text


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported to add its arguments."""
    from kvproxy import __version__

    parser = argparse.ArgumentParser(
        prog="kvproxy",
        description="A KV-cache-aware reverse proxy for agentic LLM rollouts.",
        epilog="examples:\n"
        + "\n".join(f"  {e}" for name, e in EXAMPLES.items() if name in SUBCOMMANDS),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvproxy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=HelpFormatter
        )
        if name == command:
            mod = load_command(name)
            mod.add_arguments(p)
            example = EXAMPLES.get(name) or getattr(mod, "EXAMPLE", None)
            if example and not p.epilog:
                p.epilog = f"example:\n  {example}"
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in SUBCOMMANDS else None).parse_args(argv)
    return run_command(args.command, args)


if __name__ == "__main__":
    sys.exit(main())
