"""Triton JIT options shared by the kernels."""

from __future__ import annotations

import inspect

import triton

_JIT_PARAMS = inspect.signature(triton.jit).parameters


def unspecialized(ints: tuple[str, ...] = (), pointers: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """`triton.jit` keyword arguments under which these arguments never select a new compiled variant.

    Triton compiles one variant per kind of value: an int equal to 1, or divisible by 16; a
    pointer aligned to 16 bytes or not. Arguments that change from step to step (row counts,
    slices of the slot free list) would otherwise bring a new kind now and then, and each costs
    a compilation (tens of milliseconds even from the disk cache) in the middle of serving.
    """
    options = {"do_not_specialize": list(ints)}
    if "do_not_specialize_on_alignment" in _JIT_PARAMS:
        options["do_not_specialize_on_alignment"] = [*ints, *pointers]
    return options
