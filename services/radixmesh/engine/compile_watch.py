"""Reports Triton kernels compiled while a server already serves requests.

A kernel variant compiled after start-up (a kind of argument the warm-up did not show it, on a machine whose
compile cache is empty) stalls the step that launched it by tens to hundreds of milliseconds. With
`RADIXMESH_WATCH_COMPILES=1` in the scheduler's environment every compile is timed: those during start-up are
counted and summarised at DEBUG level once the server is ready, each later one is logged as a WARNING with the
kernel's signature, so a slow first request can be traced to the variant it waited for.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

logger = logging.getLogger(__name__)

ENV = "RADIXMESH_WATCH_COMPILES"


class CompileWatch:
    """Times every Triton compile through the runtime's pre- and post-compile hooks."""

    def __init__(self) -> None:
        self.ready = False
        self.startup: list[tuple[str, float]] = []
        self.serving: list[tuple[str, float]] = []
        self._started: dict[Any, float] = {}

    def before(self, *, key: Any = None, **_: Any) -> bool:
        self._started[str(key)] = time.perf_counter()
        return False  # a true value would tell Triton to skip the compile

    def after(self, *, key: Any = None, fn: Any = None, compile: dict[str, Any] | None = None,
              **_: Any) -> None:
        started = self._started.pop(str(key), None)
        ms = (time.perf_counter() - started) * 1e3 if started is not None else float("nan")
        name = getattr(fn, "name", "?")
        if not self.ready:
            self.startup.append((name, ms))
            return
        self.serving.append((name, ms))
        details = compile or {}
        logger.warning("Triton kernel compiled while serving (%.0f ms): %s constants %s specialization %s", ms, name,
                       str(details.get("constants"))[:300], str(details.get("configs"))[:300])

    def mark_ready(self) -> None:
        self.ready = True
        total = sum(ms for _, ms in self.startup)
        logger.debug("Triton: %d kernel variants compiled during start-up, %.0f ms", len(self.startup), total)


def install_from_env() -> CompileWatch | None:
    """Hook a CompileWatch into Triton's runtime when RADIXMESH_WATCH_COMPILES is set; None otherwise."""
    if os.environ.get(ENV, "") in ("", "0"):
        return None
    from triton import knobs

    watch = CompileWatch()
    knobs.runtime.jit_cache_hook = watch.before
    knobs.runtime.jit_post_compile_hook = watch.after
    logger.warning("%s: Triton kernels compiled after start-up will be logged", ENV)
    return watch
