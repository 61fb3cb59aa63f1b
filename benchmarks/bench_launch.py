"""What a launcher costs while its ranks run: `mlx.launch` against `mlx_v41.launch`, in one run.

Each launcher starts --ranks ranks on this machine (they never open the ring: its port is unused)
that do nothing but sleep --seconds, with the launcher's stdin a pipe kept open (a terminal, a
test) and at its end (`/dev/null`: a service, `nohup`). The launcher's CPU seconds are read
from `wait4` (which counts the ranks it waited for too, so the ranks' own start is in both
columns), over its wall time: "cores" is how many cores it kept busy on average. With --runs
N each case runs N times and the medians are printed. Then what waiting costs a typed line:
--lines lines written to the launcher's stdin, each carrying the time it was written, and the
delay until each rank read it (median and max over the ranks and lines).

    python benchmarks/bench_launch.py [--ranks 2 --seconds 5 --runs 3 --lines 20]
"""

from __future__ import annotations

import argparse
import os
import signal
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
ECHO = """import os, sys, time
print("ready", flush=True)
for line in sys.stdin:
    print(os.environ["MLX_RANK"], time.time() - float(line), flush=True)
"""


def one_run(launcher: list, stdin, ranks: int, seconds: float, script: Path) -> tuple:
    """(wall seconds, CPU seconds) of one launch."""
    # (the ranks never open the ring, so the launcher's default port is enough)
    command = [*launcher, "-n", str(ranks), "--python", sys.executable, "--", str(script),
               str(seconds)]
    tic = time.monotonic()
    proc = subprocess.Popen(command, stdin=stdin, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - tic
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{launcher} exited {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime


def line_delays(launcher: list, ranks: int, lines: int, script: Path) -> list:
    """Seconds from writing each line to each rank's reading it."""
    proc = subprocess.Popen([*launcher, "-n", str(ranks), "--python", sys.executable, "--",
                             str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        for _ in range(ranks):
            proc.stdout.readline()  # "ready"
        delays = []
        for _ in range(lines):
            proc.stdin.write(f"{time.time()}\n")
            proc.stdin.flush()
            delays += [float(proc.stdout.readline().split()[1]) for _ in range(ranks)]
            time.sleep(0.13)  # lines typed apart, not in a burst
        return delays
    finally:  # the launcher never passes its stdin's end to the ranks: end them all
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--lines", type=int, default=20)
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
        echo = Path(folder) / "echo.py"
        echo.write_text(ECHO)
        print(f"\na typed line until each rank reads it ({args.lines} lines, ms)")
        for name, launcher in LAUNCHERS.items():
            delays = line_delays(launcher, args.ranks, args.lines, echo)
            print(f"  {name:<15} median {statistics.median(delays) * 1e3:5.1f}   max "
                  f"{max(delays) * 1e3:5.1f}")


if __name__ == "__main__":
    main()
