"""Prefill attention of long prompts without a cached prefix through a library kernel (cuDNN).

A request whose new tokens are its whole sequence (nothing cached) needs no KV pool reads: its
attention is plain causal self-attention over the q/k/v the layer just computed, contiguous per
request. cuDNN's fused attention (through `torch.nn.functional.scaled_dot_product_attention`) runs
that at 300-530 TFLOP/s on an H100 for 2K-4K tokens against 190-240 for the Triton extend kernel,
which stays in charge of everything else: requests with a prefix, short prompts (where it is faster),
FP8 pools (attention must see the pool's rounding). The plan is made once per pass from host-side
lengths; a backend refusal at run time turns the path off for good (logged once) and the layer falls
back to the Triton kernel.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

DENSE_PREFILL_MIN_TOKENS = 1536
"""New tokens from which a prefix-free request goes to cuDNN on CUDA (H100, 8B shape, 32/8 heads of 128:
the Triton kernel is faster at 1,024 tokens, 85 vs 103 us per layer; cuDNN at 2,048, 115 vs 178 us)."""


@dataclass(frozen=True)
class DensePlan:
    """Which requests of an extend pass run dense attention, and what is left for the Triton kernel."""

    ranges: tuple[tuple[int, int], ...]
    """Packed token rows [start, end) of the requests run dense (one SDPA call each)."""
    rest: tuple[int, ...]
    """Batch rows of the requests the Triton kernel computes (all others)."""
    rest_max_extend_len: int


def plan_dense(prefix_lens: list[int], extend_lens: list[int], min_tokens: int) -> DensePlan | None:
    """The split of one extend pass, or None when no request qualifies (the Triton kernel runs alone)."""
    if min_tokens <= 0:
        return None
    ranges: list[tuple[int, int]] = []
    rest: list[int] = []
    start = 0
    for row, (prefix, new) in enumerate(zip(prefix_lens, extend_lens)):
        if prefix == 0 and new >= min_tokens:
            ranges.append((start, start + new))
        else:
            rest.append(row)
        start += new
    if not ranges:
        return None
    return DensePlan(tuple(ranges), tuple(rest), max((extend_lens[r] for r in rest), default=0))


class DenseAttention:
    """Runs the dense share of a plan; `backends` in priority order (cuDNN first on CUDA).

    cuDNN builds an execution plan per input shape (tens of milliseconds on the host, paid by the request
    that brings a new length). Each request's q/k/v are therefore copied into buffers of `bucket`-rounded
    length, so a few shapes serve every prompt, and `warm_up` builds those plans at start. The padding sits
    after the request's last token, where causal masking keeps it out of every real row; its k/v are zeros.
    """

    def __init__(self, backends: tuple[str, ...] = ("CUDNN_ATTENTION", "FLASH_ATTENTION"), bucket: int = 256) -> None:
        assert bucket >= 1, f"bucket must be >= 1, got {bucket}"
        self.backends = backends
        self.bucket = bucket
        self.enabled = True

    def padded_len(self, n: int) -> int:
        return -(-n // self.bucket) * self.bucket

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, plan: DensePlan,
            scaling: float) -> torch.Tensor | None:
        """The planned requests' rows of the output (`[num_tokens, heads, head_dim]`): written into `out`, or,
        when one request is the whole pass, the library's own output returned in its place (no copy). None if
        the path is (now) off and nothing was written."""
        if not self.enabled:
            return None
        try:
            with self._backends():
                for start, end in plan.ranges:
                    n = end - start
                    qp, kp, vp = self._padded(q[start:end], k[start:end], v[start:end])
                    o = self._attend(qp, kp, vp, scaling)[:n]  # [n, heads, head_dim]
                    if n == q.shape[0] and o.is_contiguous():
                        return o
                    out[start:end].copy_(o)
        except RuntimeError as exc:  # no backend of the list takes these inputs here
            self._turn_off(exc)
            return None
        return out

    def warm_up(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                min_tokens: int, max_tokens: int) -> int:
        """Build the plan of every padded length from `min_tokens` to `max_tokens`; returns how many ran."""
        if not self.enabled or min_tokens <= 0 or max_tokens < min_tokens:
            return 0
        lengths = range(self.padded_len(min_tokens), self.padded_len(max_tokens) + 1, self.bucket)
        try:
            with self._backends():
                for n in lengths:
                    q = torch.zeros(n, num_heads, head_dim, dtype=dtype, device=device)
                    kv = torch.zeros(n, num_kv_heads, head_dim, dtype=dtype, device=device)
                    self._attend(q, kv, kv, head_dim**-0.5)
        except RuntimeError as exc:
            self._turn_off(exc)
            return 0
        return len(lengths)

    def _turn_off(self, exc: RuntimeError) -> None:
        self.enabled = False
        logger.warning("dense prefill attention is off (the Triton kernel runs instead): %s", str(exc)[:200])

    def _backends(self) -> contextlib.AbstractContextManager[None]:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([getattr(SDPBackend, name) for name in self.backends], set_priority=True)

    def _padded(self, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, padded = q.shape[0], self.padded_len(q.shape[0])
        # always copied: contiguous buffers of a bucketed length are the shapes and strides the plans were built for
        qp = q.new_empty((padded, *q.shape[1:]))
        qp[:n].copy_(q)  # (the padded query rows compute garbage that nobody reads)
        kp, vp = k.new_empty((padded, *k.shape[1:])), v.new_empty((padded, *v.shape[1:]))
        for dst, src in ((kp, k), (vp, v)):
            dst[:n].copy_(src)
            dst[n:].zero_()
        return qp, kp, vp

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """Causal attention of `[n, heads, head_dim]` rows (token-major, as packed); the same layout back."""
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, n, head_dim] views
        o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scaling,
                                                             enable_gqa=qh.shape[1] != kh.shape[1])
        return o.squeeze(0).transpose(0, 1)
