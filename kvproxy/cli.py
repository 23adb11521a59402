"""Command line: ``kvproxy serve | sim-engine | workload | demo``.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
Only the module of the command being run is imported, so ``kvproxy sim-engine`` never
loads the proxy and ``kvproxy serve`` never loads the simulator or the demo.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvproxy.serve", "run the proxy in front of sgl-router / smg"),
    "sim-engine": ("kvproxy.sim.cli", "run a simulated SGLang engine (no GPU needed)"),
    "workload": (
        "kvproxy.workload.driver",
        "run an agentic workload (preset or trace) against a URL",
    ),
    "demo": (
        "kvproxy.demo",
        "W1 through the real stack, features off vs on, with verdicts (--lab: lab table)",
    ),
    "doctor": ("kvproxy.doctor.cli", "check a live deployment: router, engines' flags, config"),
    "lab": ("kvproxy.lab.cli", "run engines, router, kvproxy and a workload in virtual time"),
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
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=HelpFormatter
        )
        if name == command:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            example = EXAMPLES.get(name) or getattr(mod, "EXAMPLE", None)
            if example and not p.epilog:
                p.epilog = f"example:\n  {example}"
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in SUBCOMMANDS else None).parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
