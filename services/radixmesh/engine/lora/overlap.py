"""When the LoRA shrink runs on a side CUDA stream beside the base GEMM (--lora-overlap).

The fork, the side stream and the join are `radixmesh.kernels.lora_overlap`; here only which passes take it.
"""

from __future__ import annotations

from radixmesh.engine.lora.options import LORA_OVERLAP


def may_overlap(mode: str, kind: str, segmented: bool, rows: int) -> bool:
    """Whether a CUDA projection's adapters run beside its GEMM: `mode` one of `LORA_OVERLAP`, `kind` the kernel set
    the pass runs ("rows", "grouped" or "fused": `radixmesh.kernels.lora.choose_kernels`), `segmented` a prefill
    pass."""
    assert mode in LORA_OVERLAP, f"lora overlap must be one of {LORA_OVERLAP}, got {mode!r}"
    if mode == "off" or rows == 0 or kind == "fused":  # fused: no shrink of its own
        return False
    return mode in ("on", "side") or (kind == "rows" and not segmented and rows > 1)


def expands_on_side(mode: str) -> bool:
    """Whether the expand runs on the side stream too, its sum added after the join: "side", and "auto" where it
    overlaps (H200, 8B, 32 decode rows over 16 rank-16 adapters: 0.755 of the base model's throughput against 0.743
    with the expand after the join and 0.698 without the overlap; docs/benchmarks/README.md)."""
    return mode in ("side", "auto")
