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
    "demo": ("kvproxy.demo", "run the agentic workload through the stack four ways and compare"),
    "lab": ("kvproxy.lab.cli", "run engines, router, kvproxy and a workload in virtual time"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported to add its arguments."""
    parser = argparse.ArgumentParser(
        prog="kvproxy",
        description="A KV-cache-aware reverse proxy for agentic LLM rollouts.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in SUBCOMMANDS else None).parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
