"""glibc malloc settings for the processes that run a model on the CPU.

PyTorch's CPU ops take their buffers from malloc. By default glibc serves large blocks with `mmap` and
gives memory back to the kernel as soon as the top of the heap is free, so every decode step unmaps
and maps its temporaries anew and touches fresh pages: a 50-request structured-output batch of the
default model took ~1.8 million page faults in 34 s, and each costs far more when the machine (a VM
whose host reclaims freed guest memory) has to back the page again. With these settings freed blocks
stay in the process for the next step (the same run: no page faults beyond start-up). The price is
that a process keeps its peak heap, as a GPU process keeps its cached device memory.

They are read by glibc when a process starts, so they go into the environment of the processes the
engine spawns (scheduler, tensor-parallel ranks) on the CPU; a value the user set is kept.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

CPU_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),  # blocks up to 32 MiB (glibc's largest) come from the heap
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),  # keep up to 1 GiB of free heap top instead of returning it
    "MALLOC_TOP_PAD_": str(64 << 20),  # grow the heap in 64 MiB steps
}


def compute_env(device: str, base: Mapping[str, str]) -> dict[str, str]:
    """`base` plus the CPU malloc settings it lacks when `device` is the CPU (unchanged otherwise)."""
    env = dict(base)
    if device == "cpu":
        for name, value in CPU_MALLOC_ENV.items():
            env.setdefault(name, value)
    return env


@contextmanager
def spawn_env(device: str) -> Iterator[None]:
    """Within the block, processes started by `multiprocessing` (which copy `os.environ`) get `compute_env`;
    `os.environ` is restored after it."""
    added = {k: v for k, v in compute_env(device, os.environ).items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
