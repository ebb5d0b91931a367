"""radixmesh: LLM serving with radix prefix caching, split into gRPC services.

`radixmesh.Engine` is the in-process Python API; it starts the scheduler in its own process.
"""

from __future__ import annotations

from pkgutil import extend_path
from typing import TYPE_CHECKING, Any

# radixmesh.kernels lives under kernels/radixmesh/kernels: with both roots on sys.path (PYTHONPATH=services:kernels)
# the package's path joins them; an install maps the two directories itself (pyproject package-dir).
__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from radixmesh.engine.engine import Engine
    from radixmesh.wire.sampling import SamplingParams

__all__ = ["Engine", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy so `import radixmesh` stays cheap (no torch) for CLI help and clients.
    if name == "Engine":
        from radixmesh.engine.engine import Engine

        return Engine
    if name == "SamplingParams":
        from radixmesh.wire.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
