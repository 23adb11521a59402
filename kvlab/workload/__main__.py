import sys

from kvlab.workload.driver import main

sys.exit(main())
