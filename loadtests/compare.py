"""Endpoints to benchmark, and running one workload against each in turn.

An endpoint is written `LABEL=URL[,backend=ID][,model=NAME][,header=KEY:VALUE][,grpc=HOST:PORT]...`
(`grpc=` is the public gRPC API of the server at URL, for the grpc and grpc-chat backends). Router
policies compare the same way: start one router per policy and give each its own endpoint,
or, where the router takes its policy from a request header, one URL with different
`header=` values. Runs go one after another with the same workload and arrival times, so
their figures compare.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loadtests.client import make_backend
from loadtests.metrics import summarize
from loadtests.report import RunReport
from loadtests.runner import LoadConfig, run_load
from loadtests.workloads.base import Workload


@dataclass(frozen=True)
class EndpointSpec:
    """One server (or router setting) to benchmark."""

    label: str
    base_url: str
    backend: str
    model: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    grpc_target: str | None = None
    """host:port of the server's gRPC API (grpc and grpc-chat backends)."""
    grpc_ca: str | None = None
    """CA bundle (PEM) for a gRPC API served over TLS."""


def parse_endpoint(spec: str, default_backend: str, default_model: str | None = None,
                   default_grpc_target: str | None = None, grpc_ca: str | None = None) -> EndpointSpec:
    """Parse `LABEL=URL[,backend=ID][,model=NAME][,header=KEY:VALUE][,grpc=HOST:PORT]...`."""
    head, *options = spec.split(",")
    label, sep, url = head.partition("=")
    if not sep or not label or not url.startswith(("http://", "https://")):
        raise ValueError(f"endpoint {spec!r}: expected LABEL=http://HOST:PORT[,key=value...]")
    backend, model, headers, grpc_target = default_backend, default_model, {}, default_grpc_target
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise ValueError(f"endpoint {spec!r}: option {option!r} is not key=value")
        if key == "backend":
            backend = value
        elif key == "model":
            model = value
        elif key == "grpc":
            grpc_target = value
        elif key == "header" and ":" in value:
            name, _, header_value = value.partition(":")
            headers[name.strip()] = header_value.strip()
        else:
            raise ValueError(f"endpoint {spec!r}: unknown option {option!r} (backend=, model=, header=K:V, grpc=)")
    return EndpointSpec(label=label, base_url=url.rstrip("/"), backend=backend, model=model, headers=headers,
                        grpc_target=grpc_target, grpc_ca=grpc_ca)


def check_unique_labels(endpoints: Sequence[EndpointSpec]) -> None:
    labels = [e.label for e in endpoints]
    if len(set(labels)) != len(labels):
        raise ValueError(f"endpoint labels must differ, got {labels}")


def run_endpoints(workload: Workload, endpoints: Sequence[EndpointSpec], load: LoadConfig,
                  count_tokens: Callable[[str], int]) -> list[RunReport]:
    """Run the workload against each endpoint in turn."""
    backends = [make_backend(e.backend, e.base_url, model=e.model, headers=e.headers, grpc_target=e.grpc_target,
                             grpc_ca=e.grpc_ca) for e in endpoints]
    for endpoint, backend in zip(endpoints, backends):
        if not backend.supports_token_ids and _has_token_ids(workload):
            raise ValueError(f"workload {workload.name} sends token ids; backend {endpoint.backend} cannot")
    runs = []
    for endpoint, backend in zip(endpoints, backends):
        record = asyncio.run(run_load(workload, backend, load, count_tokens))
        summary = summarize(record.results, record.duration_s)
        runs.append(RunReport(label=endpoint.label, base_url=endpoint.base_url, backend=endpoint.backend,
                              model=endpoint.model, record=record, summary=summary))
    return runs


def _has_token_ids(workload: Workload) -> bool:
    return any(isinstance(t.prompt, list) for s in workload.sessions for t in s.turns)
