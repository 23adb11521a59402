import sys

from kvproxy.cli import main

sys.exit(main())
