import sys

from kvproxy.workload.driver import main

sys.exit(main())
