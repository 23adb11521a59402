"""Runs the command line: ``python -m kvproxy``."""

import sys

from kvproxy.cli import main

sys.exit(main())
