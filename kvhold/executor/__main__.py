import sys

from kvhold.executor.runtime import main

sys.exit(main())
