"""``python -m kvproxy.workload ARGS``: the same as ``kvproxy workload ARGS``."""

import sys

from kvproxy.cli import load_command

sys.exit(load_command("workload").main())
