"""How a `ModelRunner` is built, one named step at a time.

`build_runner` runs the steps in their order; each step reads what the steps before it set on the runner:
device -> quantization -> KV dtype -> tensor-parallel checks -> load -> LoRA slots -> memory plan -> pools -> FP8 scales
-> multimodal -> EAGLE feature capture -> attention backend (and its warm-up) -> sampler -> CUDA graphs (decode,
then one-request prefills).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from radixmesh.common.env import gemv_tiles
from radixmesh.common.errors import invalid_argument
from radixmesh.engine.attention.base import AttentionBackend
from radixmesh.engine.attention.registry import create_backend
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.cuda_graph_runner import CudaGraphRunner
from radixmesh.engine.loader import PreparedModel, iter_weight_slices, iter_weights
from radixmesh.engine.loader.dummy import init_dummy_
from radixmesh.engine.memory import KVSlotAllocator, ReqToTokenPool, TokenToKVPool
from radixmesh.engine.mm.runtime import MultimodalRuntime
from radixmesh.engine.models.layers import enable_gemv
from radixmesh.engine.models.registry import LoadsWeights, model_class, model_family
from radixmesh.engine.models.weights import materialize
from radixmesh.engine.prefill_graphs import make_prefill_graphs
from radixmesh.engine.quant.build import build_linear_method
from radixmesh.engine.quant.device import resolve_kv_dtype
from radixmesh.engine.sampling.batch_info import SamplingInfoCache
from radixmesh.engine.sampling.sampler import Sampler
from radixmesh.engine.speculative.draft_setup import draft_memory_need
from radixmesh.engine.speculative.eagle_setup import build_capture

if TYPE_CHECKING:
    from radixmesh.engine.lora.runtime import LoraRuntime
    from radixmesh.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_RAM_SHARE = 0.1  # of free RAM, scaled by mem_fraction_static, when no size is given


@dataclass(frozen=True)
class MemoryPlan:
    """How many KV tokens and request rows the pools hold."""

    max_total_tokens: int
    """Slots of the KV pool."""
    max_running_requests: int
    """Rows of the request table (requests that may hold KV at once)."""
    context_len: int
    """Longest prompt plus output."""


def build_runner(runner: ModelRunner, config: EngineConfig, prepared: PreparedModel) -> None:
    """Every build step, in order (see the module docstring)."""
    runner.device = pick_device(config, runner)
    runner.config = config = config.with_device_memory(device_memory(runner.device))
    runner.dtype = DTYPES[config.dtype]
    runner.context_len = config.context_length or prepared.config.context_len
    runner.quant = build_linear_method(config.quantization, prepared.config, runner.device, runner.dtype,
                                       config.fp8_gemm_backend, fuse_quant=not config.disable_fp8_quant_fusion)
    runner.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, runner.dtype, runner.device, config.attention_backend)
    check_tp_support(runner)
    runner.model = load_model(runner, prepared)
    runner.dp = getattr(getattr(runner.model, "model", None), "dp", None)
    runner.lora = build_lora(runner)
    if runner.rank_link is not None:
        runner.rank_link.stage("loaded")  # rank 0 waits here until every rank holds its shard
    runner.plan = plan_memory(runner)
    build_pools(runner)
    set_fp8_kv_scales(runner)
    runner.mm = build_multimodal(runner)
    build_capture(runner)
    runner.attn_backend = build_attention(runner)
    runner.sampler = Sampler(seed=config.random_seed)
    runner.sampling_cache = SamplingInfoCache()
    runner.graph_runner = build_graphs(runner)
    runner.prefill_graphs = make_prefill_graphs(runner)


def pick_device(config: EngineConfig, runner: ModelRunner) -> torch.device:
    """This rank's device (`cuda:<rank>` under tensor parallelism); INVALID_ARGUMENT without CUDA."""
    tp = runner.tp
    device = torch.device("cuda", tp.rank) if tp.enabled and config.device == "cuda" else torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise invalid_argument("--device cuda was asked for but no CUDA device is available", "device")
    return device


def device_memory(device: torch.device) -> int | None:
    """The GPU's total memory in bytes (None on the CPU)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def check_tp_support(runner: ModelRunner) -> None:
    """Combinations tensor parallelism does not run yet get a clear error naming them."""
    if runner.tp.enabled:
        check_tp_combination(runner.model_config.family, runner.tp.size, runner.quant is not None,
                             runner.kv_dtype != runner.dtype)
    if runner.tp.dp_attention and runner.device.type == "cuda" and not runner.config.disable_cuda_graph:
        raise invalid_argument("--enable-dp-attention runs eager passes only: add --disable-cuda-graph",
                               "enable_dp_attention")


def check_tp_combination(family: str, tp_size: int, fp8_weights: bool, other_kv_dtype: bool) -> None:
    """INVALID_ARGUMENT for a model family or a quantization tensor parallelism does not run."""
    if not model_family(family).tensor_parallel:
        raise invalid_argument(f"tensor parallelism (--tp-size {tp_size}) runs the Llama and Qwen text models; "
                               f"{family!r} runs with --tp-size 1", "tp_size")
    if fp8_weights or other_kv_dtype:
        raise invalid_argument(f"tensor parallelism (--tp-size {tp_size}) does not run FP8 weights or an FP8 KV "
                               "cache yet: use --tp-size 1 with FP8, or bf16/fp16 weights and KV with TP", "tp_size")


def load_model(runner: ModelRunner, prepared: PreparedModel) -> torch.nn.Module:
    """The model on the runner's device with its weights (a checkpoint, this rank's slices, or random)."""
    start = time.perf_counter()
    model = _empty_model(runner)
    _fill_weights(runner, model, prepared)
    model.eval()
    configure = getattr(model, "configure_engine", None)  # (optional, see models.registry.LoadsWeights)
    if configure is not None:
        configure(runner.config)
    if runner.quant is not None:
        runner.quant.finish(model)
    _enable_fast_paths(runner, model)
    logger.info("model loaded in %.2f s", time.perf_counter() - start)
    return model


def _empty_model(runner: ModelRunner) -> torch.nn.Module:
    """The model's modules on the device, parameters allocated but not filled."""
    with torch.device("meta"):  # no memory and no init: every parameter is filled below
        cls = model_class(runner.model_config.family)
        model = cls(runner.model_config, runner.tp) if runner.tp.enabled else cls(runner.model_config)
    model = model.to(runner.dtype)  # still on meta: the quantized layers then get their own storage
    if runner.quant is not None:
        runner.quant.prepare(model)
    model = materialize(model, runner.device)
    for module in model.modules():
        init_buffers = getattr(module, "init_buffers", None)
        if init_buffers is not None:
            init_buffers()
    return model


def _fill_weights(runner: ModelRunner, model: torch.nn.Module, prepared: PreparedModel) -> None:
    config, quant = runner.config, runner.quant
    loader = cast(LoadsWeights, model)  # a class of models.registry
    if prepared.load_format == "dummy" and runner.tp.enabled:  # each rank cuts its shard of the same model
        from radixmesh.engine.distributed.dummy_weights import iter_whole_dummy_weights

        loader.load_weights(iter_whole_dummy_weights(runner.model_config, config.random_seed, runner.device,
                                                     runner.dtype))
    elif prepared.load_format == "dummy":
        init_dummy_(model, seed=config.random_seed)
        if quant is not None:
            quant.fill_dummy(model, config.random_seed)
    elif runner.tp.enabled:  # a TP rank reads only its slices of the checkpoint
        loader.load_weights(iter_weight_slices(prepared))
    else:
        weights = iter_weights(prepared)
        loader.load_weights(quant.adapt_weights(model, weights) if quant is not None else weights)


GEMV_DTYPES = (torch.bfloat16, torch.float16)
"""Model dtypes whose one-row projections run the GEMV kernels (float32 gains nothing; GPU tests add it)."""


def _enable_fast_paths(runner: ModelRunner, model: torch.nn.Module) -> None:
    """CUDA: programmatic dependent launch, and the batch-1 GEMV kernels in half precision."""
    if runner.device.type != "cuda":
        return
    from radixmesh.kernels._pdl import pdl_enabled, set_pdl
    from radixmesh.kernels.gemv import parse_tiles, set_tiles

    config = runner.config
    set_pdl(not config.disable_pdl)
    logger.info("programmatic dependent launch %s", "on" if pdl_enabled(runner.device) else "off")
    value = gemv_tiles()
    try:
        set_tiles(parse_tiles(value))
    except ValueError as exc:
        raise invalid_argument(f"RADIXMESH_GEMV_TILES: {exc}", "RADIXMESH_GEMV_TILES") from None
    if value:
        logger.info("batch-1 GEMV tiles from RADIXMESH_GEMV_TILES: %s", value)
    if runner.dtype in GEMV_DTYPES and not config.disable_gemv:
        layers = enable_gemv(model, fuse_prologues=not config.disable_gemv_fusion)
        logger.info("batch-1 GEMV kernel on for %d linear layers", layers)


def build_lora(runner: ModelRunner) -> LoraRuntime | None:
    """Adapter slots on every Llama/Qwen2 projection an adapter may target (LoRA on); before the memory plan, so
    the KV pool is sized around them."""
    config = runner.config
    if not config.lora_enabled:
        return None
    from radixmesh.engine.lora.options import target_modules
    from radixmesh.engine.lora.runtime import LoraRuntime
    from radixmesh.engine.lora.slots import SlotShape

    if not model_family(runner.model_config.family).tensor_parallel:  # the decoder-only text families
        family = runner.model_config.family
        raise invalid_argument(f"LoRA adapters run on the Llama and Qwen2 text models, not {family!r}", "enable_lora")
    shape = SlotShape(config.max_loras_per_batch, config.max_lora_rank, target_modules(config))
    lora = LoraRuntime(runner.model, runner.layout, runner.model_config.hidden_size, shape, runner.device,
                       runner.dtype, config.cuda_graph_max_bs if runner.device.type == "cuda" else 0)
    lora.state.kernels = config.lora_kernels
    lora.set_overlap(config.lora_overlap)
    if runner.tp_leader is not None:
        lora.mirror = runner.tp_leader.lora_slot
    logger.info("LoRA: %d slots of rank %d, %.1f MiB, %s decode kernels, overlap %s", shape.num_slots,
                shape.max_rank, lora.slots.num_bytes / 2**20, config.lora_kernels, config.lora_overlap)
    return lora


def plan_memory(runner: ModelRunner) -> MemoryPlan:
    """KV pool size from --max-total-tokens, or from free device memory (CPU: a share of free RAM)."""
    config, mc = runner.config, runner.model_config
    per_token = TokenToKVPool.bytes_per_token(mc.num_layers, runner.layout.num_kv_heads, mc.head_dim,
                                              runner.kv_dtype)
    draft = draft_memory_need(config, runner.dtype, mc)  # a draft model's weights and equal-length pool
    per_token += draft.kv_bytes_per_token
    if config.max_total_tokens is not None:
        total = config.max_total_tokens
    elif runner.device.type == "cuda":
        # Blocks the allocator cached while loading (dummy init, stacking shards) count as used
        # in mem_get_info: hand them back first, or the pool loses them (15.7 GB for the 8B shape on an H100).
        torch.cuda.empty_cache()
        free, all_bytes = torch.cuda.mem_get_info(runner.device)
        budget = free - all_bytes * (1 - config.mem_fraction(all_bytes)) - draft.weight_bytes
        total = int(budget // per_token)
    else:
        free_ram = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        total = int(free_ram * CPU_KV_RAM_SHARE * config.mem_fraction(None) // per_token)
    if runner.tp.enabled:  # every rank's pool has the same slots
        assert runner.tp.comm is not None
        total = runner.tp.comm.min_int(total)
    if total < 2:
        raise invalid_argument("not enough memory for a KV cache; lower the model size or free memory",
                               "mem_fraction_static")
    max_running = min(config.max_running_requests, max(total // 2, 1))
    logger.info("KV pool: %d tokens of %d bytes (%s), %.2f GiB", total, per_token,
                str(runner.kv_dtype).removeprefix("torch."), total * per_token / 2**30)
    return MemoryPlan(total, max_running, runner.context_len)


def build_pools(runner: ModelRunner) -> None:
    """The request table, the KV pool (and, under TP, the view of every rank's KV heads), the slot allocator."""
    plan, mc = runner.plan, runner.model_config
    runner.req_pool = ReqToTokenPool(plan.max_running_requests + 1, runner.context_len + 1, runner.device)
    runner.kv_pool = TokenToKVPool(plan.max_total_tokens, mc.num_layers, runner.layout.num_kv_heads, mc.head_dim,
                                   runner.kv_dtype, runner.device)
    runner.kv_transfer_pool = runner.kv_pool
    if runner.tp_leader is not None and runner.tp.dp_attention:  # rank 0 numbers every rank's slots (dp_kv)
        from radixmesh.engine.dp_kv import DpSlotAllocator

        runner.req_pool.journal = []
        runner.allocator = DpSlotAllocator(plan.max_total_tokens, runner.tp.size, runner.device)
        return
    if runner.tp_leader is not None:
        from radixmesh.engine.distributed.kv_pool import ShardedKVPool

        runner.req_pool.journal = []  # the other ranks replay rank 0's req_to_token writes
        runner.kv_transfer_pool = ShardedKVPool(runner.kv_pool, runner.tp_leader)
    runner.allocator = KVSlotAllocator(plan.max_total_tokens, runner.device)


def set_fp8_kv_scales(runner: ModelRunner) -> None:
    """An FP8 KV pool takes the checkpoint's KV scales (from the quantization method)."""
    if runner.kv_pool.is_fp8 and runner.quant is not None:
        runner.kv_pool.set_scales(runner.quant.kv_scales())


def build_multimodal(runner: ModelRunner) -> MultimodalRuntime | None:
    """Image features and M-RoPE positions of EXTEND passes (multimodal models only)."""
    if not runner.model_config.is_multimodal:
        return None
    return MultimodalRuntime(runner.model, runner.req_pool.size, runner.device)


def build_attention(runner: ModelRunner) -> AttentionBackend:
    """The attention backend, its kernels compiled for this pool (a prompt longer than the prefill budget
    is split into chunks, and chunks after the first have a prefix)."""
    config = runner.config
    backend = create_backend(config.attention_backend)
    if config.enable_dense_prefill:
        backend.enable_dense_prefill()
    if config.disable_decode_rope_fusion:
        backend.disable_decode_rope_fusion()
    backend.warm_up(runner.kv_pool, runner.layout.num_heads, min(runner.context_len, config.prefill_token_budget))
    return backend


def build_graphs(runner: ModelRunner) -> CudaGraphRunner | None:
    """Decode CUDA graphs on CUDA unless disabled (or the backend cannot replay them)."""
    config = runner.config
    if runner.device.type != "cuda" or config.disable_cuda_graph or not runner.attn_backend.supports_cuda_graph:
        return None
    return CudaGraphRunner(runner, min(config.cuda_graph_max_bs, runner.plan.max_running_requests))
