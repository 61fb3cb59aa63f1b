"""What a launcher costs while its ranks run: `mlx.launch` against `mlx_v41.launch`, in one run.

Each launcher starts --ranks ranks on this machine (ring backend over localhost, free ports)
that do nothing but sleep --seconds, with the launcher's stdin a pipe kept open (a terminal, a
test) and at its end (`/dev/null`: a service, `nohup`). The launcher's CPU seconds are read
from `wait4` (which counts the ranks it waited for too, so the ranks' own start is in both
columns), over its wall time: "cores" is how many cores it kept busy on average. With --runs
N each case runs N times and the medians are printed.

    python benchmarks/bench_launch.py [--ranks 2 --seconds 5 --runs 3]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCHERS = {"mlx.launch": ["mlx.launch"],
             "mlx_v41.launch": [sys.executable, "-m", "mlx_v41.launch"]}
STDINS = {"open pipe": subprocess.PIPE, "/dev/null": subprocess.DEVNULL}
RANK = "import time, sys; time.sleep(float(sys.argv[1]))\n"


def free_base(n: int) -> int:
    for _ in range(200):
        base = random.randint(20000, 32000 - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free ports")


def one_run(launcher: list, stdin, ranks: int, seconds: float, script: Path) -> tuple:
    """(wall seconds, CPU seconds) of one launch."""
    command = [*launcher, "-n", str(ranks), "--starting-port", str(free_base(ranks)),
               "--python", sys.executable, "--", str(script), str(seconds)]
    tic = time.monotonic()
    proc = subprocess.Popen(command, stdin=stdin, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - tic
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{launcher} exited {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "rank.py"
        script.write_text(RANK)
        print(f"{args.ranks} ranks sleeping {args.seconds:g} s; medians of {args.runs} runs")
        print(f"{'stdin':<10} {'launcher':<15} {'wall s':>7} {'CPU s':>7} {'cores':>6}")
        for stdin_name, stdin in STDINS.items():
            cpu = {}
            for name, launcher in LAUNCHERS.items():
                runs = [one_run(launcher, stdin, args.ranks, args.seconds, script)
                        for _ in range(args.runs)]
                wall = statistics.median(w for w, _ in runs)
                cpu[name] = statistics.median(c for _, c in runs)
                print(f"{stdin_name:<10} {name:<15} {wall:7.2f} {cpu[name]:7.2f} "
                      f"{cpu[name] / wall:6.2f}")
            print(f"{stdin_name:<10} mlx.launch / mlx_v41.launch CPU: "
                  f"{cpu['mlx.launch'] / cpu['mlx_v41.launch']:.1f}x")


if __name__ == "__main__":
    main()
