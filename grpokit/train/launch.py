"""`grpokit train ... --nproc N`: the same command on N local ranks under torchrun, and, when the
job fails, one line that says which rank failed and why (docs/distributed.md).

torchrun's own failure banner names the first rank that failed and its exit code or signal; a
rank that stops on an error of grpokit's (a bad config, a missing file) writes its one-line
message into the folder named by `GRPOKIT_RANK_ERRORS` (`report_rank_error`), so the line can
quote it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


ERRORS_ENV = "GRPOKIT_RANK_ERRORS"


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The command that runs `grpokit <argv>` on `nproc` local ranks through torchrun
    (torch.distributed.run), rendezvous on a free local port."""
    from grpokit.train.distributed import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "grpokit", *argv]


def report_rank_error(message: str) -> None:
    """Under `--nproc`: leave this rank's one-line error for the launcher's summary."""
    folder, rank = os.environ.get(ERRORS_ENV), os.environ.get("RANK")
    if folder and rank is not None:
        try:
            (Path(folder) / f"rank{rank}.err").write_text(message.strip().splitlines()[0][:500] if message else "")
        except OSError:
            pass


def failure_line(banner: str, errors: Path | None, nproc: int, code: int) -> str:
    """One line naming the failed rank and why, from torchrun's failure banner (its "Root Cause"
    entry) and the rank's own error message when it left one."""
    root = banner[banner.rfind("Root Cause"):] if "Root Cause" in banner else banner
    rank = re.search(r"rank\s*:\s*(\d+)", root)
    exit_ = re.search(r"exitcode\s*:\s*(-?\d+)", root)
    if rank is None:
        return f"error: the {nproc}-rank job failed (torchrun exited with {code}) before any rank reported"
    r = int(rank.group(1))
    why = ""
    if exit_ is not None:
        rc = int(exit_.group(1))
        if rc < 0:
            try:
                why = f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                why = f"killed by signal {-rc}"
        else:
            why = f"exit code {rc}"
    msg = ""
    if errors is not None and (errors / f"rank{r}.err").is_file():
        msg = (errors / f"rank{r}.err").read_text().strip()
    return f"error: rank {r} of {nproc} failed ({why or 'no exit code reported'})" + (f": {msg}" if msg else "")


def launch(nproc: int, argv: list[str]) -> int:
    """Run `grpokit <argv>` on `nproc` ranks; its output streams through as it comes (progress
    bars' carriage returns included), and a failure ends with `failure_line`. Ctrl-C reaches
    torchrun too, which stops its ranks; their last output is still passed on. Returns torchrun's
    exit status."""
    errors = Path(tempfile.mkdtemp(prefix="grpokit-ranks-"))
    tail = bytearray()
    interrupted = False
    try:
        proc = subprocess.Popen(torchrun_command(nproc, argv), env={**os.environ, ERRORS_ENV: str(errors)},
                                stderr=subprocess.PIPE)
        out = getattr(sys.stderr, "buffer", None)
        while True:
            try:
                chunk = os.read(proc.stderr.fileno(), 65536)
            except KeyboardInterrupt:         # torchrun got it too: read on until its ranks stop
                interrupted = True
                continue
            if not chunk:
                break
            if out is not None:
                out.write(chunk)
                out.flush()
            else:
                sys.stderr.write(chunk.decode(errors="replace"))
            tail += chunk
            del tail[:-65536]                 # torchrun's failure report is at the end
        proc.stderr.close()
        code = proc.wait()
        if code != 0:
            sys.stderr.flush()
            line = "interrupted" if interrupted else failure_line(tail.decode(errors="replace"), errors, nproc, code)
            print(line, file=sys.stderr)
        return code
    finally:
        shutil.rmtree(errors, ignore_errors=True)
