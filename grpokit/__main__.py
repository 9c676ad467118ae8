"""`python -m grpokit ...` (what `torchrun -m grpokit train CONFIG` runs on each rank)."""

import sys

from grpokit.cli import main

sys.exit(main())
