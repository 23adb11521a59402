"""Runs the workload driver as ``python -m kvlab.workload``."""

import sys

from kvlab.workload.driver import main

sys.exit(main())
