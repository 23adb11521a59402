"""``python -m kvproxy.workload``: the workload driver's old entry point, kept working.

The driver itself is :mod:`kvlab.workload` (``pip install 'kvproxy[lab]'``); this
package only runs it, through the command line's lazy dispatch.
"""
