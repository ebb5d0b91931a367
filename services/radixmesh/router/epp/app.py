"""The endpoint picker's parts, started and stopped with the router that holds them (`router --epp-port`)."""

from __future__ import annotations

from radixmesh.common.readiness import Readiness
from radixmesh.common.tls import TlsConfig
from radixmesh.router.adapters import AdapterAffinity
from radixmesh.router.epp.config import EppConfig
from radixmesh.router.epp.picker import EndpointPicker
from radixmesh.router.epp.server import EppServer
from radixmesh.router.epp.service import ExtProcService
from radixmesh.router.epp.tokens import PromptTokenizer
from radixmesh.router.policies.base import BaseRoutingPolicy
from radixmesh.router.workers import WorkerRegistry


class EndpointPickerApp:
    """Picker, tokenizer client, ext_proc service and port over the router's registry and policy."""

    def __init__(self, config: EppConfig, registry: WorkerRegistry, policy: BaseRoutingPolicy, block_size: int,
                 host: str = "127.0.0.1", tls: TlsConfig | None = None,
                 adapters: AdapterAffinity | None = None) -> None:
        """`adapters`: the router's LoRA adapter affinity (requests of an adapter go to workers holding it)."""
        self.config = config
        self.readiness = Readiness("endpoint picker")
        self.readiness.add("workers", "a ready worker serving HTTP", detail="no worker discovered yet")
        self.picker = EndpointPicker(config, registry, policy, adapters)
        self.tokenizer = PromptTokenizer(config.tokenizer, block_size, config.tokenize_timeout_s, config.tokenize)
        self.service = ExtProcService(config, self.picker, self.tokenizer, block_size)
        self.server = EppServer(host, config.port, self.service, self.readiness, tls)

    @property
    def port(self) -> int:
        return self.server.port

    def refresh(self) -> None:
        """Ready while some worker can be picked (called as the router refreshes its own readiness)."""
        workers = self.picker.registry.all()
        num_ready = len(self.picker.candidates())
        if num_ready:
            detail = f"{num_ready} of {len(workers)} workers can be picked"
        elif workers:
            detail = (f"none of {len(workers)} workers is healthy and serving HTTP "
                      f"({sum(1 for w in workers if w.http_port)} report an HTTP port: workers need --http-port)")
        else:
            detail = "no worker discovered yet"
        self.readiness.set("workers", num_ready > 0, "" if num_ready else detail)

    async def start(self) -> None:
        self.refresh()
        self.tokenizer.start()
        await self.server.start()

    async def stop(self, grace_s: float = 0.0) -> None:
        await self.server.stop(grace_s)
        await self.tokenizer.close()
