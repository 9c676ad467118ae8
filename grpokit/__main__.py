"""`python -m grpokit ...` (what `torchrun -m grpokit train CONFIG` runs on each rank)."""

import traceback

from grpokit.cli import main
from grpokit.train.distributed import exit_process


def _run() -> int:
    try:
        return main()
    except SystemExit as exc:                # argparse and friends
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:                    # --debug re-raises: print it as Python would
        traceback.print_exc()
        return 1


exit_process(_run())                         # a rank of a job ends without racing gloo's threads
