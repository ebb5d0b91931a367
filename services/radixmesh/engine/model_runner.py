"""Owns the model, the KV memory and the sampler; runs one batch forward and samples."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.attention.base import ForwardBatch
from radixmesh.engine.attention.registry import create_backend
from radixmesh.engine.batch import ScheduleBatch, future_index, resolve_futures
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.cuda_graph_runner import CudaGraphRunner
from radixmesh.engine.device_io import rows_to_device
from radixmesh.engine.distributed.layout import ShardLayout
from radixmesh.engine.distributed.sharding import TP_NONE, RankLink
from radixmesh.engine.grammar.vocab_mask import VocabMask
from radixmesh.engine.loader import PreparedModel, iter_weight_slices, iter_weights
from radixmesh.engine.loader.dummy import init_dummy_
from radixmesh.engine.memory import KVSlotAllocator, ReqToTokenPool, TokenToKVPool
from radixmesh.engine.mm.runtime import MultimodalRuntime, sampling_prompt_ids
from radixmesh.engine.models.layers import enable_gemv
from radixmesh.engine.models.registry import LoadsWeights, model_class
from radixmesh.engine.models.weights import materialize
from radixmesh.engine.quant.build import build_linear_method
from radixmesh.engine.quant.device import resolve_kv_dtype
from radixmesh.engine.request import Req
from radixmesh.engine.sampling.batch_info import SamplingBatchInfo, SamplingInfoCache
from radixmesh.engine.sampling.prompt_logprobs import score_prompt_tokens
from radixmesh.engine.sampling.sampler import SampleOutput, Sampler
from radixmesh.engine.speculative.draft_setup import draft_memory_need

if TYPE_CHECKING:
    from radixmesh.engine.distributed.leader import TpLeader

logger = logging.getLogger(__name__)

TP_FAMILIES = ("llama", "qwen2", "qwen3")
"""Model families whose layers shard across tensor-parallel ranks."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_RAM_SHARE = 0.1  # of free RAM, scaled by mem_fraction_static, when no size is given


@dataclass(frozen=True)
class MemoryPlan:
    max_total_tokens: int
    max_running_requests: int
    context_len: int


class ModelRunner:
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
        self.layout = ShardLayout.of(prepared.config, self.tp.rank, self.tp.size)
        """This rank's heads, MLP width and vocabulary rows (the whole model without TP)."""
        try:
            self._build(config, prepared)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, prepared: PreparedModel) -> None:
        self.device = torch.device("cuda", self.tp.rank) if self.tp.enabled and config.device == "cuda" \
            else torch.device(config.device)
        self.dtype = _DTYPES[config.dtype]
        self.context_len = config.context_length or prepared.config.context_len
        self._check_device()
        self.quant = build_linear_method(config.quantization, prepared.config, self.device, self.dtype,
                                         config.fp8_gemm_backend)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, self.device, config.attention_backend)
        if self.tp.enabled:
            _check_tp_support(self.model_config.family, self.tp.size, self.quant is not None,
                              self.kv_dtype != self.dtype)
        self.model = self._load_model(prepared)
        if self.rank_link is not None:
            self.rank_link.stage("loaded")  # rank 0 waits here until every rank holds its shard
        self.plan = self._plan_memory()
        mc = self.model_config
        self.req_pool = ReqToTokenPool(self.plan.max_running_requests + 1, self.context_len + 1, self.device)
        self.kv_pool = TokenToKVPool(self.plan.max_total_tokens, mc.num_layers, self.layout.num_kv_heads,
                                     mc.head_dim, self.kv_dtype, self.device)
        if self.kv_pool.is_fp8 and self.quant is not None:
            self.kv_pool.set_scales(self.quant.kv_scales())
        self.kv_transfer_pool = self.kv_pool
        """The pool KV transports read and write: under TP, all ranks' KV heads (`ShardedKVPool`)."""
        if self.tp_leader is not None:
            from radixmesh.engine.distributed.kv_pool import ShardedKVPool

            self.req_pool.journal = []  # the other ranks replay rank 0's req_to_token writes
            self.kv_transfer_pool = ShardedKVPool(self.kv_pool, self.tp_leader)
        self.allocator = KVSlotAllocator(self.plan.max_total_tokens, self.device)
        self.mm = MultimodalRuntime(self.model, self.req_pool.size, self.device) if mc.is_multimodal else None
        """Image features and M-RoPE positions of EXTEND passes (multimodal models only)."""
        self.attn_backend = create_backend(config.attention_backend)
        if config.enable_dense_prefill:
            self.attn_backend.enable_dense_prefill()
        # (a longer prompt is split into chunks, and chunks after the first have a prefix)
        self.attn_backend.warm_up(self.kv_pool, self.layout.num_heads,
                                  min(self.context_len, config.prefill_token_budget))
        self.sampler = Sampler(seed=config.random_seed)
        self.sampling_cache = SamplingInfoCache()
        self.graph_runner: CudaGraphRunner | None = None
        if self.device.type == "cuda" and not config.disable_cuda_graph and self.attn_backend.supports_cuda_graph:
            self.graph_runner = CudaGraphRunner(self, min(config.cuda_graph_max_bs, self.plan.max_running_requests))
        self.last_tokens: torch.Tensor | None = None

    def _check_device(self) -> None:
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise invalid_argument("--device cuda was asked for but no CUDA device is available", "device")

    def _load_model(self, prepared: PreparedModel) -> torch.nn.Module:
        start = time.perf_counter()
        with torch.device("meta"):  # no memory and no init: every parameter is filled below
            cls = model_class(self.model_config)
            model = cls(self.model_config, self.tp) if self.tp.enabled else cls(self.model_config)
        model = model.to(self.dtype)  # still on meta: the quantized layers then get their own storage
        if self.quant is not None:
            self.quant.prepare(model)
        model = materialize(model, self.device)
        loader = cast(LoadsWeights, model)  # a class of models.registry
        for module in model.modules():
            init_buffers = getattr(module, "init_buffers", None)
            if init_buffers is not None:
                init_buffers()
        if prepared.load_format == "dummy" and self.tp.enabled:  # each rank cuts its shard of the same model
            from radixmesh.engine.distributed.dummy_weights import iter_whole_dummy_weights

            loader.load_weights(iter_whole_dummy_weights(self.model_config, self.config.random_seed, self.device,
                                                         self.dtype))
        elif prepared.load_format == "dummy":
            init_dummy_(model, seed=self.config.random_seed)
            if self.quant is not None:
                self.quant.fill_dummy(model, self.config.random_seed)
        elif self.tp.enabled:  # a TP rank reads only its slices of the checkpoint
            loader.load_weights(iter_weight_slices(prepared))
        else:
            weights = iter_weights(prepared)
            loader.load_weights(self.quant.adapt_weights(model, weights) if self.quant is not None else weights)
        model.eval()
        if self.quant is not None:
            self.quant.finish(model)
        half = self.dtype in (torch.bfloat16, torch.float16)
        if self.device.type == "cuda":
            from radixmesh.kernels._pdl import pdl_enabled, set_pdl

            set_pdl(not self.config.disable_pdl)
            logger.info("programmatic dependent launch %s", "on" if pdl_enabled(self.device) else "off")
        if self.device.type == "cuda" and half and not self.config.disable_gemv:
            layers = enable_gemv(model, fuse_prologues=not self.config.disable_gemv_fusion)
            logger.info("batch-1 GEMV kernel on for %d linear layers", layers)
        logger.info("model loaded in %.2f s", time.perf_counter() - start)
        return model

    def _plan_memory(self) -> MemoryPlan:
        mc = self.model_config
        per_token = TokenToKVPool.bytes_per_token(mc.num_layers, self.layout.num_kv_heads, mc.head_dim,
                                                  self.kv_dtype)
        draft = draft_memory_need(self.config, self.dtype)  # a draft model's weights and equal-length pool
        per_token += draft.kv_bytes_per_token
        if self.config.max_total_tokens is not None:
            total = self.config.max_total_tokens
        elif self.device.type == "cuda":
            # Blocks the allocator cached while loading (dummy init, stacking shards) count as used
            # in mem_get_info: hand them back first, or the pool loses them (15.7 GB for the 8B shape on an H100).
            torch.cuda.empty_cache()
            free, all_bytes = torch.cuda.mem_get_info(self.device)
            budget = free - all_bytes * (1 - self.config.mem_fraction(all_bytes)) - draft.weight_bytes
            total = int(budget // per_token)
        else:
            free_ram = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            total = int(free_ram * CPU_KV_RAM_SHARE * self.config.mem_fraction(None) // per_token)
        if self.tp.enabled:  # every rank's pool has the same slots
            assert self.tp.comm is not None
            total = self.tp.comm.min_int(total)
        if total < 2:
            raise invalid_argument("not enough memory for a KV cache; lower the model size or free memory",
                                   "mem_fraction_static")
        max_running = min(self.config.max_running_requests, max(total // 2, 1))
        logger.info("KV pool: %d tokens of %d bytes (%s), %.2f GiB", total, per_token,
                    str(self.kv_dtype).removeprefix("torch."), total * per_token / 2**30)
        return MemoryPlan(total, max_running, self.context_len)

    def memory_info(self) -> dict[str, object]:
        """What /server_info reports about KV capacity and quantization."""
        mc = self.model_config
        info: dict[str, object] = {
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "kv_bytes_per_token": TokenToKVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                                                self.kv_dtype),
            "quantization": None}
        if self.quant is not None:
            info.update(self.quant.describe())
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
            self.tp_leader.publish_forward(batch, self.req_pool.drain_journal())
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch, self.last_tokens)
        fb = self._forward_batch(batch)
        if self.mm is not None:
            fb.mm = self.mm.prepare(batch)
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
                                       lambda: self._build_sampling_info(reqs))
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
        if self.graph_runner is not None:
            self.graph_runner.release()

    def _build_sampling_info(self, reqs: list[Req]) -> SamplingBatchInfo:
        return SamplingBatchInfo.build(
            [r.params for r in reqs], [sampling_prompt_ids(r) for r in reqs], [r.output_ids for r in reqs],
            self.model_config.eos_token_ids, self.model_config.vocab_size, self.device,
            output_lens=[r.num_output_tokens for r in reqs])


def _check_tp_support(family: str, tp_size: int, fp8_weights: bool, other_kv_dtype: bool) -> None:
    """Combinations tensor parallelism does not run yet get a clear error naming them."""
    if family not in TP_FAMILIES:
        raise invalid_argument(f"tensor parallelism (--tp-size {tp_size}) runs the Llama and Qwen text models; "
                               f"{family!r} runs with --tp-size 1", "tp_size")
    if fp8_weights or other_kv_dtype:
        raise invalid_argument(f"tensor parallelism (--tp-size {tp_size}) does not run FP8 weights or an FP8 KV "
                               "cache yet: use --tp-size 1 with FP8, or bf16/fp16 weights and KV with TP", "tp_size")
