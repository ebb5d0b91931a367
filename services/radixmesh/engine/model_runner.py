"""Owns the model, the KV memory and the sampler; runs one batch forward and samples.

How it is built (device, quantization, load, memory plan, pools, graphs, ...) is runner_build.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from radixmesh.engine.attention.base import AttentionBackend, ForwardBatch
from radixmesh.engine.batch import ScheduleBatch, future_index, resolve_futures
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.cuda_graph_runner import CudaGraphRunner
from radixmesh.engine.device_io import rows_to_device
from radixmesh.engine.distributed.layout import ShardLayout
from radixmesh.engine.distributed.sharding import TP_NONE, RankLink
from radixmesh.engine.grammar.vocab_mask import VocabMask
from radixmesh.engine.loader import PreparedModel
from radixmesh.engine.memory import KVSlotAllocator, ReqToTokenPool, TokenToKVPool
from radixmesh.engine.mm.runtime import MultimodalRuntime, sampling_prompt_ids
from radixmesh.engine.prefill_graphs import PrefillGraphRunner
from radixmesh.engine.quant.base import LinearMethod
from radixmesh.engine.request import Req
from radixmesh.engine.runner_build import MemoryPlan, build_runner
from radixmesh.engine.sampling.batch_info import SamplingBatchInfo, SamplingInfoCache
from radixmesh.engine.sampling.prompt_logprobs import score_prompt_tokens
from radixmesh.engine.sampling.sampler import SampleOutput, Sampler

if TYPE_CHECKING:
    from radixmesh.engine.distributed.dp_attention import DpAttention
    from radixmesh.engine.distributed.leader import TpLeader
    from radixmesh.engine.lora.runtime import LoraRuntime


class ModelRunner:
    """One model replica (or one tensor-parallel rank of it) with its KV memory."""

    # set by runner_build.build_runner, in this order
    device: torch.device
    dtype: torch.dtype
    context_len: int
    quant: LinearMethod | None
    kv_dtype: torch.dtype
    model: torch.nn.Module
    plan: MemoryPlan
    req_pool: ReqToTokenPool
    kv_pool: TokenToKVPool
    kv_transfer_pool: TokenToKVPool
    """The pool KV transports read and write: under TP, all ranks' KV heads (`ShardedKVPool`)."""
    allocator: KVSlotAllocator
    mm: MultimodalRuntime | None
    """Image features and M-RoPE positions of EXTEND passes (multimodal models only)."""
    attn_backend: AttentionBackend
    sampler: Sampler
    sampling_cache: SamplingInfoCache
    graph_runner: CudaGraphRunner | None
    prefill_graphs: PrefillGraphRunner | None = None
    """One-request prefills of up to `--prefill-graph-max-tokens` new tokens through captured graphs."""
    lora: LoraRuntime | None = None
    """Adapter slots and the per-pass slot choice (LoRA on)."""
    dp: DpAttention | None = None
    """Data-parallel attention's token exchange (`--enable-dp-attention`): each pass runs this rank's share."""

    def __init__(self, config: EngineConfig, prepared: PreparedModel, rank_link: RankLink | None = None) -> None:
        """`rank_link`: a tensor-parallel rank other than 0 (`follower.FollowerLink`); without one,
        `config.tp_size > 1` makes this runner rank 0, which starts the other ranks."""
        self.config = config
        self.model_config = prepared.config
        self.tp_leader: TpLeader | None = None
        if rank_link is None and config.tp_size > 1:
            from radixmesh.engine.distributed.leader import TpLeader

            rank_link = self.tp_leader = TpLeader.start(config, prepared)
        self.rank_link = rank_link
        self.tp = rank_link.tp if rank_link is not None else TP_NONE
        self.layout = ShardLayout.of(prepared.config, self.tp.rank, self.tp.size, self.tp.dp_attention)
        """This rank's heads, MLP width and vocabulary rows (the whole model without TP)."""
        try:
            build_runner(self, config, prepared)
        except BaseException:
            self.close()
            raise
        self.last_tokens: torch.Tensor | None = None

    def memory_info(self) -> dict[str, object]:
        """What /server_info reports: KV capacity, quantization and the model's own figures (MoE: experts' load)."""
        mc = self.model_config
        info: dict[str, object] = {
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "kv_bytes_per_token": TokenToKVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                                                self.kv_dtype),
            "quantization": None}
        if self.quant is not None:
            info.update(self.quant.describe())
        model_info = getattr(self.model, "server_info", None)  # (optional, see models.registry.LoadsWeights)
        if model_info is not None:
            info.update(model_info())
        return info

    def launch(self, batch: ScheduleBatch,
               before_sample: Callable[[], VocabMask | None] | None = None) -> SampleOutput:
        """Forward and sample without waiting for the device; tokens stay on the device.

        `before_sample` runs on the host while the forward pass is queued on the device and
        returns the grammar masks of this batch (built from host state it may first update).
        The results' copy to the host is started last (`SampleOutput.to_host` waits for it).
        """
        logits = self.forward(batch)
        num_reqs = len(batch.reqs)
        vocab_mask = before_sample() if before_sample is not None else None
        sampled = self.sample(batch, logits[:num_reqs], vocab_mask)
        if self.tp_leader is not None:
            self.tp_leader.share_tokens(sampled.next_token_ids)
        plan = batch.prompt_logprobs
        if plan is not None and plan.rows:
            top_n = max((r.params.top_logprobs for r, n in zip(batch.reqs, plan.counts) if n), default=0)
            sampled.prompt_logprobs = score_prompt_tokens(logits[num_reqs:], plan.targets, top_n)
        sampled.start_copy()
        self.last_tokens = sampled.next_token_ids
        return sampled

    def forward(self, batch: ScheduleBatch) -> torch.Tensor:
        """Logits (float32) for each request's last new token `[batch, vocab]`, then for the packed
        tokens that score prompt log-probs `[num_scored, vocab]` (EXTEND only)."""
        if self.tp_leader is not None:  # the same pass on every rank
            self.tp_leader.publish_forward(batch, self.req_pool.drain_journal(), self.lora is not None)
        if self.dp is not None:
            return self._forward_share(batch)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch, self.last_tokens)
        if self.prefill_graphs is not None:
            length = self.prefill_graphs.length(batch)
            if length is not None:
                return self.prefill_graphs.replay(batch, length)
        fb = self._forward_batch(batch)
        if self.lora is not None:
            self.lora.prepare(batch)
        if self.mm is not None:
            fb.mm = self.mm.prepare(batch)
        self.attn_backend.init_forward_metadata(fb)
        logits: torch.Tensor = self.model(fb.input_ids, fb.positions, fb)
        return logits

    def _forward_share(self, batch: ScheduleBatch) -> torch.Tensor:
        """Data-parallel attention: the pass over this rank's requests of `batch` (every rank's MLP tokens meet
        inside the model); the whole batch's logits on rank 0, none elsewhere."""
        assert self.dp is not None
        from radixmesh.engine.distributed.dp_batch import split_batch

        share, plan = split_batch(batch, self.tp.size, self.tp.rank)
        if batch.is_decode and self.tp_leader is not None:  # the scheduler's table holds every request's slots
            rows, positions = rows_to_device([batch.req_pool_indices, batch.positions], self.device)
            self.req_pool.req_to_token[rows, positions] = batch.out_cache_loc
        self.dp.begin(plan)
        fb = self._forward_batch(share)
        if share.reqs:
            self.attn_backend.init_forward_metadata(fb)
        logits: torch.Tensor = self.model(fb.input_ids, fb.positions, fb)
        return logits

    def _forward_batch(self, batch: ScheduleBatch) -> ForwardBatch:
        """The device inputs of an eager pass, all from one host-to-device copy (no sync)."""
        num_prev = self.last_tokens.shape[0] if self.last_tokens is not None else 0
        futures = future_index(batch.future_rows, num_prev)
        plan = batch.prompt_logprobs
        extra_rows = plan.rows if plan is not None and plan.rows else None
        input_ids, positions, pool_rows, seq_lens, prefix_lens, extend_lens, index, extra = rows_to_device(
            [batch.input_ids, batch.positions, batch.req_pool_indices, batch.seq_lens, batch.prefix_lens,
             batch.extend_lens, futures.index if futures is not None else [], extra_rows or []], self.device)
        if futures is not None:
            # tokens the previous launch sampled, resolved on the device: no host sync
            assert self.last_tokens is not None, "future tokens without a previous launch"
            resolve_futures(input_ids, futures, index, self.last_tokens)
        if batch.is_decode:
            self.req_pool.req_to_token[pool_rows, positions] = batch.out_cache_loc  # the new tokens' slots
        return ForwardBatch(
            mode=batch.mode, input_ids=input_ids, positions=positions, out_cache_loc=batch.out_cache_loc,
            req_pool_indices=pool_rows, seq_lens=seq_lens, extend_prefix_lens=prefix_lens,
            extend_seq_lens=extend_lens, req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
            attn_backend=self.attn_backend, seq_lens_cpu=batch.seq_lens, extend_prefix_lens_cpu=batch.prefix_lens,
            extend_seq_lens_cpu=batch.extend_lens, extra_logit_rows=extra if extra_rows is not None else None,
            req_pool_indices_cpu=batch.req_pool_indices)

    def sample(self, batch: ScheduleBatch, logits: torch.Tensor, vocab_mask: VocabMask | None = None) -> SampleOutput:
        reqs = batch.reqs
        info = self.sampling_cache.get(reqs, [r.num_output_tokens for r in reqs],
                                       lambda: self._build_sampling_info(reqs), keep=batch.is_decode)
        info.vocab_mask = vocab_mask
        return self.sampler(logits, info, return_logprobs=info.return_logprobs,
                            top_logprobs_num=info.top_logprobs_num)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0; nothing to do otherwise)."""
        if self.tp_leader is not None:
            self.release_graphs()
            self.tp_leader.close()

    def release_graphs(self) -> None:
        """Drop the captured CUDA graphs before this rank leaves its tensor-parallel group (see
        `CudaGraphRunner.release`)."""
        graph_runner = getattr(self, "graph_runner", None)  # (None yet when the build failed before it)
        if graph_runner is not None:
            graph_runner.release()

    def _build_sampling_info(self, reqs: list[Req]) -> SamplingBatchInfo:
        return SamplingBatchInfo.build(
            [r.params for r in reqs], [sampling_prompt_ids(r) for r in reqs], [r.output_ids for r in reqs],
            self.model_config.eos_token_ids, self.model_config.vocab_size, self.device,
            output_lens=[r.num_output_tokens for r in reqs])

