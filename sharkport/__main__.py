"""`python -m sharkport COMMAND ...`: the same as the `sharkport` command (sharkport/cli.py)."""

import sys

from .cli import main

sys.exit(main())
