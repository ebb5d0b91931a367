"""Where a process's busy time goes, from py-spy's raw stacks (`py-spy record -f raw`).

    python scripts/pyspy_summary.py STACKS.txt [--top N] [--depth D] [--rate HZ]

Idle samples (a thread waiting in select/epoll, or a thread pool's worker waiting for work) are
left out. Prints the busy seconds, then the project frames (services/, kernels/, loadtests/)
that hold the most busy samples inclusively, and the innermost frames that hold them exclusively.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

IDLE_LEAVES = ("select (selectors.py", "_worker (concurrent/futures/thread.py", "Thread.run (threading.py",
               "poll (zmq", "Poller.poll (zmq", "wait (threading.py", "_wait_for_tstate_lock")
PROJECT_DIRS = ("services/", "kernels/", "loadtests/", "radixmesh/")


def summarize(path: Path, top: int, depth: int, rate_hz: float) -> str:
    inclusive: collections.Counter[str] = collections.Counter()
    exclusive: collections.Counter[str] = collections.Counter()
    busy = idle = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        if any(frames[-1].startswith(leaf) or leaf in frames[-1] for leaf in IDLE_LEAVES):
            idle += count
            continue
        busy += count
        exclusive[frames[-1]] += count
        project = [f for f in frames if any(d in f for d in PROJECT_DIRS)]
        for frame in set(project[-depth:]):
            inclusive[frame] += count
    lines = [f"{path.name}: busy {busy / rate_hz:.2f} s, idle {idle / rate_hz:.2f} s (at {rate_hz:g} Hz)"]
    lines += ["  inclusive (project frames):"]
    lines += [f"    {n / rate_hz:7.3f} s  {frame}" for frame, n in inclusive.most_common(top)]
    lines += ["  exclusive (innermost frames):"]
    lines += [f"    {n / rate_hz:7.3f} s  {frame}" for frame, n in exclusive.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stacks", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--depth", type=int, default=3, help="innermost project frames credited per sample")
    parser.add_argument("--rate", type=float, default=100.0, help="the sampling rate py-spy ran at")
    args = parser.parse_args()
    for path in args.stacks:
        print(summarize(path, args.top, args.depth, args.rate))


if __name__ == "__main__":
    main()
