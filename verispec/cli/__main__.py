"""`python -m verispec.cli`: the `verispec` command."""

import sys

from verispec.cli import main

sys.exit(main())
