"""What the engine's side paths ask of a model runner: one dense model on one device, decode CUDA graphs, no LoRA,
multimodal inputs or speculative decoding.

The one-request prefill graphs (engine/prefill_graphs.py) and the decode stream (scheduler/decode_stream.py) both
need it: graphs pad a pass with rows no request owns and a prefill runs beside a decode step, which only a model
whose layers keep rows apart and share no workspaces between passes allows (MoE routing does neither), and the
features below bring per-pass state of their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixmesh.engine.model_runner import ModelRunner


def refusal(runner: ModelRunner) -> str | None:
    """Why `runner` is not such a runner (None: it is)."""
    if runner.graph_runner is None:
        return "no decode CUDA graphs"
    if not getattr(runner.model, "rows_independent", False):
        return "a MoE model (its layers mix a pass's rows and share workspaces between passes)"
    if runner.lora is not None or runner.mm is not None or runner.dp is not None or runner.tp.enabled:
        return "LoRA, a multimodal model or tensor or data parallelism"
    if runner.config.speculative_algorithm:
        return "speculative decoding"
    return None
