"""`mlx_v41.launch`: MLX's `mlx.launch`, with the same arguments and behaviour, whose launcher
waits for its ranks instead of polling them.

    mlx_v41.launch -n 2 -- -m mlx_v41.server --model path/to/converted --pipeline
    mlx_v41.launch --hostfile hosts.json -- -m mlx_v41.chat --model path/to/converted

`mlx.launch` (MLX 0.32, `mlx/_distributed_utils/launch.py`) gives each rank a thread that asks
`select` whether the rank's stdout or stderr has output *or its stdin can take more*. A pipe
can nearly always take more, so the call returns at once and the thread turns again without
waiting; with the launcher's own stdin at its end (a service, `nohup`, `< /dev/null`) its main
loop does the same. Measured on Linux: a launcher of two ranks that only sleep keeps 1.3-1.4
cores busy for as long as they run (benchmarks/bench_launch.py), a whole day for a server left
running, and on a machine with few cores it takes them from the ranks.

This command runs MLX's own launcher with one change, the `select` its loops call (its module's
name only; nothing else in the process is touched):

* asked for writable fds as well (a rank's thread), it first waits up to `WAIT` seconds for
  output, which it hands on as soon as it comes, then reports the writable fds that are ready:
  a line typed to the launcher reaches the ranks at most 2 x `WAIT` later (the thread takes
  it from its queue after one wait and writes it after the next);
* asked about the launcher's own stdin when that is at its end (readable only because a read
  returns nothing), it waits out the loop's timeout and reports nothing, which is what the
  loop would have done with the empty read.

The same ranks run in the same environment, with mlx.launch's signals, output prefixes and exit
codes. If MLX's launcher is not laid out as this expects, it runs unchanged (and polls).
"""

from __future__ import annotations

import fcntl
import os
import select as select_module
import sys
import termios
import time
from typing import Optional, Sequence

WAIT = 0.02  # seconds a rank's thread waits for output before it writes pending input
_select = select_module.select


def _at_end(fd: int) -> bool:
    """A readable fd with nothing to read: a pipe or file at its end, or the null device."""
    try:
        count = bytearray(4)
        fcntl.ioctl(fd, termios.FIONREAD, count)
        return int.from_bytes(count, sys.byteorder) == 0
    except OSError:  # not a pipe, socket, tty or file: the null device reads as its end
        try:
            mine, null = os.fstat(fd), os.stat(os.devnull)
        except OSError:
            return False
        return (mine.st_dev, mine.st_ino) == (null.st_dev, null.st_ino)


def waiting_select(rlist, wlist, xlist, timeout=None):
    """`select.select` for the launcher's loops, waiting where theirs would return at once."""
    if wlist:
        wait = WAIT if timeout is None else min(WAIT, timeout)
        if rlist:
            ready = _select(rlist, [], xlist, wait)[0]
        else:
            time.sleep(wait)
            ready = []
        return ready, _select([], wlist, [], 0)[1], []
    ready, _, errors = _select(rlist, [], xlist, timeout)
    if ready and all(fd == 0 for fd in ready) and _at_end(0):
        if timeout:
            time.sleep(timeout)
        return [], [], errors
    return ready, [], errors


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        from mlx._distributed_utils import launch
    except ImportError:  # another MLX: its launcher as it is
        try:
            os.execvp("mlx.launch", ["mlx.launch", *argv])
        except OSError as e:
            print(f"mlx_v41.launch: error: cannot run mlx.launch ({e})", file=sys.stderr)
            return 2
    if getattr(launch, "select", None) is _select:
        launch.select = waiting_select
    sys.argv = ["mlx_v41.launch", *argv]
    return launch.main() or 0


if __name__ == "__main__":
    sys.exit(main())
