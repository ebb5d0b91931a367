"""Keep Python's cyclic garbage collector off the objects a service builds once at startup.

A service holds tens of thousands of long-lived container objects (imported modules, a tokenizer's
vocabulary, configuration); every full collection walks all of them, ~10-35 ms on the CPUs we run on,
and stalls whatever request or stream the event loop was serving. Freezing moves the objects alive now
into the permanent generation, which collections skip; garbage made later is collected as before.
RADIXMESH_GC_FREEZE=0 turns it off (to compare).
"""

from __future__ import annotations

import gc
import os


def freeze_startup_objects() -> None:
    """Collect once (so no garbage is frozen with them), then exempt every live object from later collections.
    Call when startup's allocations are done; calling again later freezes what was added since."""
    if os.environ.get("RADIXMESH_GC_FREEZE", "1") == "0":
        return
    gc.collect()
    gc.freeze()
