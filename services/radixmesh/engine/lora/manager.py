"""Which adapters the scheduler process holds: in host memory (up to --max-loaded-loras, least recently used
leaves first) and in device slots (--max-loras-per-batch; a slot is rewritten only when no admitted request
uses its adapter, least recently used first).

Loading reads and checks the adapter files before anything changes, so a bad adapter fails its load call
alone and a load never disturbs a running request: it never takes a slot a running request uses.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from typing import Any

from radixmesh.common.errors import invalid_argument, not_found
from radixmesh.engine.lora.adapter import LoraAdapter, load_adapter
from radixmesh.engine.lora.runtime import LoraRuntime
from radixmesh.engine.model_config import ModelConfig
from radixmesh.wire.lora import adapter_namespace

_stamp = itertools.count(1)


class LoraManager:
    """Adapters by name, in host memory and in device slots."""

    def __init__(self, runtime: LoraRuntime, model_config: ModelConfig, max_rank: int, max_loaded: int) -> None:
        self.runtime = runtime
        self.model_config = model_config
        self.max_rank, self.max_loaded = max_rank, max_loaded
        self.adapters: OrderedDict[str, LoraAdapter] = OrderedDict()
        """Loaded adapters, least recently used first."""
        num_slots = runtime.slots.shape.num_slots
        self.slot_names: list[str | None] = [None] * num_slots
        self.slot_used: list[int] = [0] * num_slots
        """Stamp of each slot's last use (LRU among slots free to rewrite)."""
        self.num_slot_loads = 0
        self.last_load_s = 0.0

    # ---- host memory ------------------------------------------------------------------------
    def load(self, name: str, path: str, pinned: set[str] = frozenset()) -> dict[str, Any]:  # type: ignore[assignment]
        """Read, check and keep adapter `name`; `pinned`: adapters requests use now (never unloaded to make
        room). INVALID_ARGUMENT for a bad adapter or a name in use."""
        if name in self.adapters:
            raise invalid_argument(f"LoRA adapter {name!r} is already loaded (unload it first)", "lora_name")
        start = time.perf_counter()
        adapter = load_adapter(name, path, self.model_config, self.max_rank)
        missing = self.runtime.slots.targets_of(adapter)
        if missing:
            raise invalid_argument(f"LoRA adapter {name!r} targets {', '.join(missing)}; this server has slots for "
                                   f"{', '.join(self.runtime.slots.shape.targets)} (--lora-target-modules)",
                                   "lora_path")
        clash = next((n for n in self.adapters if adapter_namespace(n) == adapter_namespace(name)), None)
        if clash is not None:
            raise invalid_argument(f"LoRA adapter name {name!r} shares its cache namespace with {clash!r}; "
                                   "choose another name", "lora_name")
        while len(self.adapters) >= self.max_loaded:
            self._drop_lru(pinned)
        self.adapters[name] = adapter
        self.last_load_s = time.perf_counter() - start
        return {"name": name, "path": path, "rank": adapter.rank, "targets": list(adapter.targets),
                "load_s": round(self.last_load_s, 4)}

    def unload(self, name: str, pinned: set[str]) -> None:
        """Forget adapter `name` (NOT_FOUND if unknown; INVALID_ARGUMENT while requests use it)."""
        if name not in self.adapters:
            raise not_found(f"LoRA adapter {name!r} is not loaded", "lora_name")
        if name in pinned:
            raise invalid_argument(f"LoRA adapter {name!r} is in use by queued or running requests; unload it "
                                   "when they finish", "lora_name")
        self._forget(name)

    def _drop_lru(self, pinned: set[str]) -> None:
        victim = next((n for n in self.adapters if n not in pinned), None)
        if victim is None:
            raise invalid_argument(f"--max-loaded-loras {self.max_loaded} adapters are loaded and all in use",
                                   "lora_name")
        self._forget(victim)

    def _forget(self, name: str) -> None:
        del self.adapters[name]
        if name in self.slot_names:
            slot = self.slot_names.index(name)
            self.slot_names[slot] = None
            self.runtime.clear(slot)

    def has(self, name: str) -> bool:
        return name in self.adapters

    # ---- device slots -----------------------------------------------------------------------
    def slot_for(self, name: str, busy: set[int]) -> int | None:
        """The slot holding adapter `name`, loading it into a free or least recently used slot outside `busy`
        (slots admitted requests use); None when every slot is busy."""
        stamp = next(_stamp)
        self.adapters.move_to_end(name)
        if name in self.slot_names:
            slot = self.slot_names.index(name)
            self.slot_used[slot] = stamp
            return slot
        free = [s for s in range(len(self.slot_names)) if s not in busy]
        if not free:
            return None
        slot = min(free, key=lambda s: (self.slot_names[s] is not None, self.slot_used[s]))
        self.runtime.write(slot, self.adapters[name])
        self.slot_names[slot] = name
        self.slot_used[slot] = stamp
        self.num_slot_loads += 1
        return slot

    def info(self) -> list[dict[str, Any]]:
        """Loaded adapters, most recently used first, with their slots."""
        return [{"name": a.name, "path": a.path, "rank": a.rank, "scaling": a.scaling, "targets": list(a.targets),
                 "on_device": a.name in self.slot_names, "host_bytes": a.num_bytes}
                for a in reversed(self.adapters.values())]
