"""When the LoRA shrink runs on a side CUDA stream beside the base GEMM (--lora-overlap).

The fork, the side stream and the join are `radixmesh.kernels.lora_overlap`; here only which passes take it.
"""

from __future__ import annotations

from radixmesh.engine.lora.options import LORA_OVERLAP


def may_overlap(mode: str, kind: str, segmented: bool, rows: int, on_cuda: bool) -> bool:
    """Whether a projection's adapters run beside its GEMM: `mode` one of `LORA_OVERLAP`, `kind` the kernel set the
    pass runs ("rows", "grouped" or "fused": `radixmesh.kernels.lora.choose_kernels`), `segmented` a prefill pass."""
    assert mode in LORA_OVERLAP, f"lora overlap must be one of {LORA_OVERLAP}, got {mode!r}"
    if mode == "off" or not on_cuda or rows == 0 or kind == "fused":  # fused: no shrink of its own
        return False
    return mode in ("on", "side") or (kind == "rows" and not segmented and rows > 1)
