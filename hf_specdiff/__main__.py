"""`python -m hf_specdiff ...`: the `hf-specdiff` command, for environments whose scripts folder is not on PATH."""

import sys

from .cli import console_main

sys.exit(console_main())
