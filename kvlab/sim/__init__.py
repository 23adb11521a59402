"""The SGLang engine simulator: a pure scheduler and radix cache, and an aiohttp shell.

``kvproxy sim-engine`` runs it over HTTP; the lab drives the same scheduler in virtual
time. docs/simulator.md lists the modules, one concern each.
"""
