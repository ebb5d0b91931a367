"""Owns the model, the KV memory and the sampler; runs one batch forward and samples."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.attention.base import ForwardBatch
from radixmesh.engine.attention.registry import create_backend
from radixmesh.engine.batch import ScheduleBatch, future_index, resolve_futures
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.cuda_graph_runner import CudaGraphRunner
from radixmesh.engine.device_io import rows_to_device
from radixmesh.engine.grammar.vocab_mask import VocabMask
from radixmesh.engine.loader import PreparedModel, iter_weights
from radixmesh.engine.loader.dummy import init_dummy_
from radixmesh.engine.memory import KVSlotAllocator, ReqToTokenPool, TokenToKVPool
from radixmesh.engine.models.layers import enable_gemv
from radixmesh.engine.models.registry import model_class
from radixmesh.engine.request import Req
from radixmesh.engine.sampling.batch_info import SamplingBatchInfo, SamplingInfoCache
from radixmesh.engine.sampling.prompt_logprobs import score_prompt_tokens
from radixmesh.engine.sampling.sampler import SampleOutput, Sampler
from radixmesh.engine.speculative.draft_setup import draft_memory_need

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_RAM_SHARE = 0.1  # of free RAM, scaled by mem_fraction_static, when no size is given


@dataclass(frozen=True)
class MemoryPlan:
    max_total_tokens: int
    max_running_requests: int
    context_len: int


class ModelRunner:
    def __init__(self, config: EngineConfig, prepared: PreparedModel) -> None:
        self.config = config
        self.model_config = prepared.config
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.dtype]
        self.context_len = config.context_length or prepared.config.context_len
        self.model = self._load_model(prepared)
        self.plan = self._plan_memory()
        mc = self.model_config
        self.req_pool = ReqToTokenPool(self.plan.max_running_requests + 1, self.context_len + 1, self.device)
        self.kv_pool = TokenToKVPool(self.plan.max_total_tokens, mc.num_layers, mc.num_kv_heads,
                                     mc.head_dim, self.dtype, self.device)
        self.allocator = KVSlotAllocator(self.plan.max_total_tokens, self.device)
        self.attn_backend = create_backend(config.attention_backend)
        self.sampler = Sampler(seed=config.random_seed)
        self.sampling_cache = SamplingInfoCache()
        self.graph_runner: CudaGraphRunner | None = None
        if self.device.type == "cuda" and not config.disable_cuda_graph and self.attn_backend.supports_cuda_graph:
            self.graph_runner = CudaGraphRunner(self, min(config.cuda_graph_max_bs, self.plan.max_running_requests))
        self.last_tokens: torch.Tensor | None = None

    def _load_model(self, prepared: PreparedModel) -> torch.nn.Module:
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise invalid_argument("--device cuda was asked for but no CUDA device is available", "device")
        start = time.perf_counter()
        with torch.device("meta"):  # no memory and no init: every parameter is filled below
            model = model_class(self.model_config)(self.model_config)
        model = model.to_empty(device=self.device).to(self.dtype)
        for module in model.modules():
            if hasattr(module, "init_buffers"):
                module.init_buffers()
        if prepared.load_format == "dummy":
            init_dummy_(model, seed=self.config.random_seed)
        else:
            model.load_weights(iter_weights(prepared))
        model.eval()
        half = self.dtype in (torch.bfloat16, torch.float16)
        if self.device.type == "cuda" and half and not self.config.disable_gemv:
            logger.info("batch-1 GEMV kernel on for %d linear layers", enable_gemv(model))
        logger.info("model loaded in %.2f s", time.perf_counter() - start)
        return model

    def _plan_memory(self) -> MemoryPlan:
        mc = self.model_config
        per_token = TokenToKVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype)
        draft = draft_memory_need(self.config, self.dtype)  # a draft model's weights and equal-length pool
        per_token += draft.kv_bytes_per_token
        if self.config.max_total_tokens is not None:
            total = self.config.max_total_tokens
        elif self.device.type == "cuda":
            # Blocks the allocator cached while loading (dummy init, stacking shards) count as used
            # in mem_get_info: hand them back first, or the pool loses them (15.7 GB for the 8B shape on an H100).
            torch.cuda.empty_cache()
            free, all_bytes = torch.cuda.mem_get_info(self.device)
            budget = free - all_bytes * (1 - self.config.mem_fraction_static) - draft.weight_bytes
            total = int(budget // per_token)
        else:
            free_ram = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            total = int(free_ram * CPU_KV_RAM_SHARE * self.config.mem_fraction_static // per_token)
        if total < 2:
            raise invalid_argument("not enough memory for a KV cache; lower the model size or free memory",
                                   "mem_fraction_static")
        max_running = min(self.config.max_running_requests, max(total // 2, 1))
        return MemoryPlan(total, max_running, self.context_len)

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
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch, self.last_tokens)
        fb = self._forward_batch(batch)
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

    def _build_sampling_info(self, reqs: list[Req]) -> SamplingBatchInfo:
        return SamplingBatchInfo.build(
            [r.params for r in reqs], [r.origin_input_ids for r in reqs], [r.output_ids for r in reqs],
            self.model_config.eos_token_ids, self.model_config.vocab_size, self.device,
            output_lens=[r.num_output_tokens for r in reqs])
