"""`python -m kvhold`: the same command as `kvhold`."""
import sys

from kvhold.cli.main import main

sys.exit(main())
