"""`python -m torchfuse ...`: see torchfuse/cli.py."""
import sys

from .cli import main

sys.exit(main())
