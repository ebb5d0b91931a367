"""LoRA in the scheduler, as a hook: requests name adapters, admission gives each a device slot.

At intake a request of an unknown adapter fails (NOT_FOUND naming it) and a known one gets its adapter's
prefix-cache namespace. Each admission pass lets a waiting request in only when its adapter is in a slot or
can be loaded into one no admitted request uses, so a batch mixes at most --max-loras-per-batch adapters
(and the base model) and a running request's slot never changes under it. Load, unload and list messages from
the front end are answered here too.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.lora.manager import LoraManager
from radixmesh.engine.scheduler.hooks import SchedulerHook
from radixmesh.wire.lora import adapter_namespace, parse_lora_path
from radixmesh.wire.messages import LoraListReqMsg, LoraLoadReqMsg, LoraUnloadReqMsg

if TYPE_CHECKING:
    from radixmesh.engine.request import Req
    from radixmesh.engine.scheduler.core import Scheduler

logger = logging.getLogger(__name__)
LORA_MSG_TYPES = (LoraLoadReqMsg, LoraUnloadReqMsg, LoraListReqMsg)


class LoraHook(SchedulerHook):
    def __init__(self, sched: Scheduler) -> None:
        runtime = sched.runner.lora
        assert runtime is not None, "LoRA is on but the model runner has no adapter slots"
        self.sched = sched
        config = sched.config
        self.manager = LoraManager(runtime, sched.runner.model_config, config.max_lora_rank, config.max_loaded_loras)
        for item in config.lora_paths:
            name, path = parse_lora_path(item)
            logger.info("LoRA adapter %s: %s", name, self.manager.load(name, path))

    # ---- intake -----------------------------------------------------------------------------
    def take_request(self, req: Req) -> bool:
        if req.lora_name is None:
            return False
        if not self.manager.has(req.lora_name):
            self.sched.fail(req, f"LoRA adapter {req.lora_name!r} is not loaded on this server", "not_found")
            return True
        req.cache_namespace = adapter_namespace(req.lora_name)
        return False

    # ---- admission --------------------------------------------------------------------------
    def admissible(self, waiting: list[Req]) -> list[Req]:
        busy = {r.lora_slot for r in self._admitted() if r.lora_slot >= 0}
        allowed: list[Req] = []
        for req in waiting:
            if req.lora_name is None:
                req.lora_slot = -1
                allowed.append(req)
                continue
            slot = self.manager.slot_for(req.lora_name, busy)
            req.lora_slot = -1 if slot is None else slot
            if slot is not None:
                busy.add(slot)
                allowed.append(req)
        return allowed

    def _admitted(self) -> list[Req]:
        chunked = self.sched.prefill.chunked_req
        return [*self.sched.running, *([chunked] if chunked is not None else [])]

    def _in_use(self) -> set[str]:
        return {r.lora_name for r in [*self._admitted(), *self.sched.prefill.waiting] if r.lora_name is not None}

    # ---- messages from the front end --------------------------------------------------------
    def handle(self, msg: LoraLoadReqMsg | LoraUnloadReqMsg | LoraListReqMsg, reply: Any) -> None:
        """Answer one load / unload / list message with `reply(query_id, result)`; errors as
        `{"error": message, "code": code}`."""
        try:
            if isinstance(msg, LoraLoadReqMsg):
                result: dict[str, Any] = self.manager.load(msg.name, msg.path, self._in_use())
            elif isinstance(msg, LoraUnloadReqMsg):
                self.manager.unload(msg.name, self._in_use())
                result = {"name": msg.name, "unloaded": True}
            else:
                result = {"adapters": self.manager.info()}
        except RadixMeshError as exc:
            result = {"error": exc.message, "code": exc.code.value}
        reply(msg.query_id, result)

    # ---- other ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        running = Counter(r.lora_name for r in self._admitted() if r.lora_name is not None)
        waiting = Counter(r.lora_name for r in self.sched.prefill.waiting if r.lora_name is not None)
        return {"lora_adapters": list(self.manager.adapters), "lora_running": dict(running),
                "lora_waiting": dict(waiting), "max_loras_per_batch": len(self.manager.slot_names),
                "lora_slot_loads": self.manager.num_slot_loads}


def create_hook(sched: Scheduler) -> LoraHook | None:
    return LoraHook(sched) if sched.config.lora_enabled else None
