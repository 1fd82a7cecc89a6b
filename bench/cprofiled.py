"""``cgroupd`` under cProfile, switched on and off from outside.

SIGUSR1 starts profiling, SIGUSR2 stops it and writes the stats to OUT (pstats format),
so a benchmark profiles exactly its measured window and not the start-up. Times are CPU
times of the process (``time.process_time``), so waiting in ``select`` costs nothing.

Usage: ``python -m bench.cprofiled OUT -- <cgroupd arguments>``.
"""

from __future__ import annotations

import cProfile
import signal
import sys
import time
from types import FrameType

from cgroupd.cli import main


def run(out: str, argv: list[str]) -> None:
    profiler = cProfile.Profile(time.process_time)

    def start(signum: int, frame: FrameType | None) -> None:
        profiler.enable()

    def stop(signum: int, frame: FrameType | None) -> None:
        profiler.disable()
        profiler.dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    main(argv)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        sys.exit("usage: python -m bench.cprofiled OUT -- <cgroupd arguments>")
    run(sys.argv[1], sys.argv[3:])
