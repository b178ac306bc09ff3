import sys

from executor.runtime import main

sys.exit(main())
