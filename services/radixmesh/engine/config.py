"""Engine configuration: frozen once built; `resolve()` turns "auto" values into concrete ones."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from radixmesh.common.errors import invalid_argument

SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
MAX_TP_SIZE = 64
MOE_DISPATCHES = ("auto", "all-reduce", "all-to-all")
MAX_DRAFT_TOKENS = 16
MAX_NGRAM_MATCH = 16
DRAFT_MODEL_ALGORITHMS = ("draft", "eagle", "eagle3", "oracle")
"""Speculative algorithms that run a draft model (EAGLE: a head; oracle: only for its cost, in benchmarks)."""
MAX_EAGLE_TOPK = 8
DEFAULT_MEM_FRACTION = 0.85
LARGE_GPU_MEM_FRACTION = 0.9
LARGE_GPU_BYTES = 60 << 30
"""GPUs with at least this much memory default to LARGE_GPU_MEM_FRACTION (`EngineConfig.mem_fraction`)."""
DEFAULT_CHUNKED_PREFILL = 4096
"""The chunk size on the CPU, and wherever the device's memory is not known yet."""
CHUNK_SIZE_BY_GPU_MEMORY = ((35 << 30, 2048), (60 << 30, 4096), (160 << 30, 8192))
"""(GPU memory below, chunk size) in order; larger GPUs: 16,384. SGLang's own tiers: on an H100 or H200 it prefills
8,192 tokens a pass, so a prompt of 4,097-8,192 tokens (the `random` text workload re-tokenizes 6-8% of its
<= 4,096-id prompts to more) takes one pass, not two."""
LARGEST_GPU_CHUNK = 16384


def chunk_size_for(device_bytes: int | None) -> int:
    """The default `chunked_prefill_size` for a GPU of `device_bytes` (None: the CPU)."""
    if device_bytes is None:
        return DEFAULT_CHUNKED_PREFILL
    return next((size for below, size in CHUNK_SIZE_BY_GPU_MEMORY if device_bytes < below), LARGEST_GPU_CHUNK)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the scheduler process needs to build the model and run requests."""

    model: str | None = None
    """Model name, local HF directory or .gguf file; None means the default model."""
    load_format: str = "auto"
    """auto | safetensors | gguf | dummy (random weights of the model's shape)."""
    tokenizer: str | None = None
    """Tokenizer directory, Hugging Face hub id or default-model name; None: the model's own."""
    device: str = "auto"
    """auto (cuda when available) | cpu | cuda."""
    dtype: str = "auto"
    """auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16."""
    attention_backend: str = "auto"
    """auto (triton on CUDA, torch-native on CPU) | torch-native | triton | flashinfer."""
    mem_fraction_static: float | None = None
    """Fraction of device memory for weights plus KV pool (GPU; default 0.9 on GPUs of 60 GiB or more, 0.85 on
    smaller ones); of free RAM for KV (CPU: 0.1 of it; default 0.85)."""
    max_total_tokens: int | None = None
    """KV pool capacity in tokens; overrides mem_fraction_static."""
    max_running_requests: int = 256
    """Most requests decoding at once."""
    chunked_prefill_size: int | None = None
    """Most prompt tokens per prefill pass; longer prompts are split; -1 disables chunking. None: by the device's
    memory (`chunk_size_for`: 8,192 on an H100 or H200, 4,096 on the CPU), filled in by the model runner
    (`with_device_memory`)."""
    max_prefill_tokens: int = 16384
    """Most prompt tokens per prefill pass when chunking is disabled."""
    schedule_policy: str = "lpm"
    """lpm (longest cached prefix first) | fcfs (arrival order) | dfs-weight (depth-first over the
    prefix cache, branches with more waiting requests first)."""
    schedule_policy_window: int = 128
    """lpm and dfs-weight match and reorder at most this many of the oldest waiting requests per
    step (the rest follow in arrival order), which bounds their cost on long queues."""
    in_batch_prefix_threshold: int = 32
    """Under lpm and dfs-weight, a waiting request sharing at least this many uncached prompt tokens
    with one admitted before it waits a step and reuses its KV, so the shared prefix is computed
    once (0: off)."""
    disable_radix_cache: bool = False
    """Turn prefix caching off (every prompt is computed from scratch)."""
    enable_hierarchical_cache: bool = False
    """Keep KV evicted from the device pool in a host-memory tier and load it back on a hit (docs/hicache.md)."""
    hicache_size: float = 0.0
    """Host tier size in GB (10^9 bytes; pinned memory on CUDA); 0: hicache_ratio times the device pool."""
    hicache_ratio: float = 2.0
    """Host tier size as a multiple of the device KV pool's tokens, when hicache_size is 0."""
    hicache_write_policy: str = "write-through"
    """write-through (new KV is copied to the host at once; eviction only frees) | write-back (copied when
    evicted from the device)."""
    context_length: int | None = None
    """Override the model's context length (max prompt + output tokens)."""
    init_new_token_ratio: float = 0.7
    """Share of each running request's remaining max_new_tokens reserved at admission."""
    min_new_token_ratio: float = 0.14
    """Floor the reservation ratio decays to while no retraction happens."""
    new_token_ratio_decay_steps: int = 600
    """Decode steps over which the ratio decays from init to min."""
    overlap_schedule: str = "auto"
    """auto (on for CUDA) | on | off: schedule batch N+1 on the CPU while the device runs batch N."""
    disable_cuda_graph: bool = False
    """Run decode eagerly instead of replaying captured CUDA graphs."""
    disable_gemv: bool = False
    """Batch-1 linear layers on CUDA use cuBLAS instead of the GEMV kernel (bf16/fp16 weights)."""
    disable_gemv_fusion: bool = False
    """Batch-1 decode runs RMSNorm and SiLU-and-mul as launches of their own, not inside the next GEMV."""
    disable_fp8_quant_fusion: bool = False
    """FP8 weights on CUDA: quantize each projection's activations in a launch of their own, not inside the RMSNorm
    or SiLU-and-mul kernel before it."""
    disable_launch_pacing: bool = False
    """Launch each decode step as soon as the previous one's results are read. By default, with overlap on CUDA and
    no request waiting for admission, the scheduler holds each decode launch until shortly before the device's
    running step ends, listening for requests, so that one arriving meanwhile starts its prefill a step sooner
    (scheduler/pacing.py; on an H100, 8B, 100 prompts at 1 req/s, the same prompts with and without on one machine:
    time to first token 3.0 ms shorter per request (median of the differences), ITL 7.11 vs 7.09 ms)."""
    disable_decode_stream: bool = False
    """Keep decode steps and prefills on one CUDA stream. By default (CUDA, overlap, decode graphs, a dense model, no
    LoRA, TP/DP, speculation or host tier) decode steps run on a stream of their own: a prefill launched while a
    decode step runs starts beside it instead of after it (scheduler/decode_stream.py; H200, 8B, text prompts at
    1 req/s: time to first token 1.2 ms shorter per request, ITL unchanged)."""
    disable_prefill_warmup: bool = False
    """Report ready without first running one prefill of each of a range of prompt lengths and a few decode steps
    at each batch-size bucket (CUDA only; a few seconds at start for an 8B model): the first requests then load the
    GEMM library's kernels and compile Triton kernel variants themselves (scheduler/warmup.py)."""
    enable_dense_prefill: bool = False
    """Triton backend: prefill attention of prompts of 1,536 tokens or more with nothing cached runs through
    PyTorch's SDPA (cuDNN's fused attention on CUDA: 1.5-2.2x the Triton kernel's speed at 2-4K tokens; a 4K-token
    8B prefill 98-102 ms instead of 109 on an H100) instead of the extend kernel. Off by default: the 500-prompt
    offline benchmark did not gain (docs/benchmarks/README.md)."""
    disable_decode_rope_fusion: bool = False
    """Triton backend: run Qwen3's q/k norms, rotary and new-token KV store as a launch of their own before decode
    attention, not inside its split kernel (on by default: one launch fewer per layer; Qwen3-30B-A3B at batch 1 on
    an H200 2.552 -> 2.520 ms a step, the offline run unchanged; docs/benchmarks/README.md)."""
    disable_pdl: bool = False
    """Launch the decode kernels without programmatic dependent launch (on by default on Hopper and later: a
    kernel's programs start, and a GEMV loads its first weights, while the kernel before it finishes)."""
    quantization: str | None = None
    """Linear layers: fp8 (weights quantized at load to FP8 e4m3, one scale per output channel; activations
    with dynamic per-token scales). None: as the checkpoint is (FP8 checkpoints run in FP8)."""
    kv_cache_dtype: str = "auto"
    """KV pool storage: auto (the model's dtype) | fp8_e4m3 | fp8_e5m2 (per-tensor scales, ~2x the tokens of bf16)."""
    fp8_gemm_backend: str = "auto"
    """FP8 GEMMs: auto (torch._scaled_mm or the Triton kernel, whichever measures faster per shape at load) |
    scaled-mm | triton."""
    prefill_graph_max_tokens: int = 1024
    """Prefills of one request with up to this many new tokens (16 or more) replay a captured CUDA graph, padded to
    the next of a few lengths (engine/prefill_graphs.py), instead of launching ~10 kernels a layer from Python (an 8B
    prefill's launches take ~20 ms of host time on an H200 host, longer than the device's work below ~1,000
    tokens). 0: every prefill eager. CUDA with decode graphs only; dense (not MoE) models without LoRA, TP or
    speculative decoding."""
    cuda_graph_max_bs: int = 256
    """Largest decode batch captured in a CUDA graph; larger batches run eagerly. 256 (the default of
    max_running_requests): the 500-prompt offline run on an H100 gained 0.7% (bf16) and 2.6% (FP8) over 160."""
    random_seed: int = 0
    """Seed of the engine's shared generator (requests without their own seed)."""
    log_level: str = "warning"
    """Python logging level of the scheduler process."""
    kv_events_block_size: int = 0
    """Report full blocks of this many tokens the radix cache stores/evicts to the front end (0: off)."""
    grammar_backend: str = "xgrammar"
    """Engine of structured outputs (json_schema, regex, ebnf, response_format): xgrammar."""
    grammar_compile_timeout: float = 30.0
    """Seconds a request may wait for its grammar to compile; past that, only that request fails."""
    grammar_compile_threads: int = 2
    """Threads compiling grammars beside the scheduler loop (which never waits on them)."""
    grammar_cache_size: int = 256
    """Compiled grammars kept (LRU by content); an identical spec compiles once."""
    enable_jump_forward: bool = False
    """Append text a grammar forces without one forward pass per token (re-tokenized at the boundary)."""
    grammar_service: str | None = None
    """host:port of `radixmesh grammar`: fetch compiled grammars from it (compile here if it is unreachable)."""
    tp_size: int = 1
    """Tensor-parallel ranks of this worker (one device each; NCCL on CUDA, gloo on CPU): docs/tensor-parallel.md."""
    enable_custom_all_reduce: bool = False
    """TP on CUDA: small all-reduces by a one-shot kernel over CUDA-IPC buffers instead of NCCL (needs GPU P2P)."""
    ep_size: int = 1
    """MoE models: spread the experts over this many ranks of the tensor-parallel group (1, or --tp-size; attention
    stays tensor-parallel unless --enable-dp-attention). 1: every rank holds a slice of every expert (docs/moe.md)."""
    enable_dp_attention: bool = False
    """MoE models with --ep-size = --tp-size > 1: data-parallel attention. Each rank holds the whole attention and
    runs only its own share of the requests, whose KV lives in its pool alone; the ranks' tokens are gathered for
    the MLP layers. Eager passes only (give --disable-cuda-graph on CUDA): docs/moe.md."""
    moe_dispatch: str = "auto"
    """Expert parallelism: how tokens reach the ranks holding their experts. all-reduce: every rank runs its experts
    on all tokens and one all-reduce sums the ranks' parts (the reduce-scatter + all-gather pair; in CUDA graphs, and
    over the custom all-reduce where it fits). all-to-all: each rank routes its share of the tokens, sends each
    token to its experts' ranks and gets the results back (eager passes; graphs keep all-reduce). auto: all-to-all
    from moe_a2a_min_tokens tokens up."""
    moe_a2a_min_tokens: int = 1024
    """moe_dispatch auto: the smallest eager pass (tokens) dispatched by all-to-all."""
    speculative_algorithm: str | None = None
    """Speculative decoding: ngram (drafts looked up in the request's own prompt and output) | draft (a
    small draft model, --speculative-draft-model) | eagle | eagle3 (an EAGLE or EAGLE-3 head, --speculative-draft-model,
    reading the target's hidden states) | oracle (benchmarks only: bench speculative --oracle); unset: off."""
    speculative_num_draft_tokens: int = 4
    """Most draft tokens verified per request and step (the back-off may propose fewer), 1 to 16; eagle/eagle3 with
    --speculative-eagle-topk > 1: the tokens of a verified tree, its root (the last sampled token) included, so
    the tree keeps that many less one of its best draft nodes (2 to 16)."""
    speculative_num_steps: int | None = None
    """eagle/eagle3: draft steps per cycle (the depth of the chain or tree); unset: --speculative-num-draft-tokens
    (a chain)."""
    speculative_eagle_topk: int = 1
    """eagle/eagle3: branches per draft step (1: a chain; more: a tree verified with a tree mask), 1 to 8."""
    speculative_draft_model: str | None = None
    """Draft model of --speculative-algorithm draft (name, HF directory, .gguf file or named shape); it must
    share the target's tokenizer."""
    speculative_draft_load_format: str = "auto"
    """auto | safetensors | gguf | dummy: how the draft model's weights load (dummy: random, seeded like the target)."""
    speculative_ngram_min_match: int = 2
    """ngram: shortest suffix of the request's tokens that must recur earlier for a lookup to propose drafts."""
    speculative_ngram_max_match: int = 4
    """ngram: longest suffix tried first (longer matches propose better drafts), at most 16."""
    disable_speculative_backoff: bool = False
    """Always propose the full number of drafts (no back-off per request or batch size): benchmarks only."""
    enable_lora: bool = False
    """Serve LoRA adapters (implied by --lora-paths): adapters load at run time (/load_lora_adapter) into
    device slots; docs/lora.md."""
    lora_paths: tuple[str, ...] = ()
    """PEFT LoRA adapters loaded at start, as NAME=PATH (or PATH, named after its directory)."""
    max_loras_per_batch: int = 8
    """Device slots for adapters: at most this many different adapters run in one batch (the base model is free)."""
    max_loaded_loras: int = 64
    """Adapters kept in host memory; past that the least recently used one not on the device is unloaded."""
    max_lora_rank: int = 64
    """Largest adapter rank served (the slots' size), up to 256; adapters of a larger rank are refused at load."""
    lora_kernels: str = "auto"
    """Decode LoRA kernels on CUDA: auto (epilogue at one row where the GEMV runs, else rows) | epilogue (one
    shrink launch per layer input, the expand in the batch-1 GEMV's epilogue) | rows (a shrink and an expand
    program per row) | grouped (by adapter) | fused (one launch per projection); prefill takes per-request ones."""
    lora_overlap: str = "auto"
    """CUDA: run the adapters' shrink on a side stream beside the base GEMM: auto (decode batches of more than one
    row with the per-row kernels; the expand on the side stream too, its sum added after the join) | on (every pass
    whose adapters run as a separate shrink and expand; the expand after the join) | side (as on, the expand on the
    side stream too) | off."""
    lora_target_modules: tuple[str, ...] = ()
    """Projections with adapter slots (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; empty: all);
    an adapter targeting another one is refused at load."""

    def __post_init__(self) -> None:
        _in(self.device, DEVICES, "device")
        _in(self.dtype, DTYPES, "dtype")
        _in(self.schedule_policy, SCHEDULE_POLICIES, "schedule_policy")
        _in(self.overlap_schedule, ("auto", "on", "off"), "overlap_schedule")
        if self.cuda_graph_max_bs < 1:
            raise invalid_argument("cuda_graph_max_bs must be >= 1", "cuda_graph_max_bs")
        if self.prefill_graph_max_tokens < 0:
            raise invalid_argument("prefill_graph_max_tokens must be >= 0 (0: no prefill graphs)",
                                   "prefill_graph_max_tokens")
        _in(self.load_format, LOAD_FORMATS, "load_format")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise invalid_argument("mem_fraction_static must be in (0, 1)", "mem_fraction_static")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise invalid_argument("max_total_tokens must be >= 2", "max_total_tokens")
        if self.max_running_requests < 1:
            raise invalid_argument("max_running_requests must be >= 1", "max_running_requests")
        if self.chunked_prefill_size is not None and (self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1):
            raise invalid_argument("chunked_prefill_size must be -1 (off) or >= 1", "chunked_prefill_size")
        if self.schedule_policy_window < 1:
            raise invalid_argument("schedule_policy_window must be >= 1", "schedule_policy_window")
        if self.in_batch_prefix_threshold < 0:
            raise invalid_argument("in_batch_prefix_threshold must be >= 0", "in_batch_prefix_threshold")
        if self.max_prefill_tokens < 1:
            raise invalid_argument("max_prefill_tokens must be >= 1", "max_prefill_tokens")
        if not 0 < self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise invalid_argument("need 0 < min_new_token_ratio <= init_new_token_ratio <= 1",
                                   "init_new_token_ratio")
        if self.kv_events_block_size < 0:
            raise invalid_argument("kv_events_block_size must be >= 0", "kv_events_block_size")
        if self.context_length is not None and self.context_length < 2:
            raise invalid_argument("context_length must be >= 2", "context_length")
        if not 1 <= self.tp_size <= MAX_TP_SIZE:
            raise invalid_argument(f"tp_size must be in [1, {MAX_TP_SIZE}] (got {self.tp_size})", "tp_size")
        self._check_moe_options()
        self._check_attention_backend()
        self._check_grammar_options()
        self._check_quant_options()
        self._check_speculative_options()
        from radixmesh.engine.lora.options import check_lora_options

        check_lora_options(self)
        from radixmesh.engine.hicache.options import check_hicache_options

        check_hicache_options(self)

    def _check_attention_backend(self) -> None:
        """An unknown id fails here, not in the scheduler process once the model has loaded."""
        from radixmesh.engine.attention.registry import ATTENTION_BACKENDS

        if self.attention_backend != "auto":
            ATTENTION_BACKENDS.check(self.attention_backend)

    def _check_moe_options(self) -> None:
        if self.ep_size not in (1, self.tp_size):
            raise invalid_argument(f"ep_size must be 1 or equal tp_size ({self.tp_size}): experts spread over all "
                                   f"ranks of the tensor-parallel group or none (got {self.ep_size})", "ep_size")
        _in(self.moe_dispatch, MOE_DISPATCHES, "moe_dispatch")
        if self.moe_a2a_min_tokens < 1:
            raise invalid_argument("moe_a2a_min_tokens must be >= 1", "moe_a2a_min_tokens")
        if self.enable_dp_attention:
            self._check_dp_attention()

    def _check_dp_attention(self) -> None:
        """What data-parallel attention does not run (yet) fails here, naming the flag to change."""
        flag = "enable_dp_attention"
        if self.tp_size < 2 or self.ep_size != self.tp_size:
            raise invalid_argument(f"--enable-dp-attention needs --tp-size N > 1 with --ep-size N (the experts spread "
                                   f"over the ranks whose attention runs data-parallel); got --tp-size {self.tp_size} "
                                   f"--ep-size {self.ep_size}", flag)
        refused = {"--speculative-algorithm": self.speculative_algorithm is not None,
                   "--enable-lora / --lora-paths": self.lora_enabled,
                   "--enable-hierarchical-cache": self.enable_hierarchical_cache,
                   "--enable-custom-all-reduce": self.enable_custom_all_reduce,
                   "--quantization": self.quantization is not None}
        for name, given in refused.items():
            if given:
                raise invalid_argument(f"--enable-dp-attention does not run with {name} yet", flag)
        if self.device == "cuda" and not self.disable_cuda_graph:
            raise invalid_argument("--enable-dp-attention runs eager passes only: CUDA graphs do not capture its "
                                   "variable-length token gathers yet; add --disable-cuda-graph", flag)

    def _check_quant_options(self) -> None:
        from radixmesh.engine.quant.registry import FP8_GEMM_BACKENDS, KV_CACHE_DTYPES, QUANT_METHODS

        if self.quantization is not None:
            _in(self.quantization, tuple(QUANT_METHODS), "quantization")
        _in(self.kv_cache_dtype, KV_CACHE_DTYPES, "kv_cache_dtype")
        _in(self.fp8_gemm_backend, FP8_GEMM_BACKENDS, "fp8_gemm_backend")

    def _check_grammar_options(self) -> None:
        from radixmesh.engine.grammar.registry import GRAMMAR_BACKENDS

        _in(self.grammar_backend, tuple(GRAMMAR_BACKENDS), "grammar_backend")
        if not self.grammar_compile_timeout > 0:
            raise invalid_argument("grammar_compile_timeout must be > 0 seconds", "grammar_compile_timeout")
        if self.grammar_compile_threads < 1:
            raise invalid_argument("grammar_compile_threads must be >= 1", "grammar_compile_threads")
        if self.grammar_cache_size < 1:
            raise invalid_argument("grammar_cache_size must be >= 1", "grammar_cache_size")

    def _check_speculative_options(self) -> None:
        from radixmesh.engine.speculative.registry import PROPOSERS

        algorithm = self.speculative_algorithm
        if algorithm is not None:
            _in(algorithm, tuple(PROPOSERS), "speculative_algorithm")
        if not 1 <= self.speculative_num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise invalid_argument(f"speculative_num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}]",
                                   "speculative_num_draft_tokens")
        if algorithm in ("draft", "eagle", "eagle3") and self.speculative_draft_model is None:
            raise invalid_argument(f"--speculative-algorithm {algorithm} needs --speculative-draft-model",
                                   "speculative_draft_model")
        if self.speculative_num_steps is not None and not 1 <= self.speculative_num_steps <= MAX_DRAFT_TOKENS:
            raise invalid_argument(f"speculative_num_steps must be in [1, {MAX_DRAFT_TOKENS}]", "speculative_num_steps")
        if not 1 <= self.speculative_eagle_topk <= MAX_EAGLE_TOPK:
            raise invalid_argument(f"speculative_eagle_topk must be in [1, {MAX_EAGLE_TOPK}]", "speculative_eagle_topk")
        if (self.speculative_eagle_topk > 1 or self.speculative_num_steps is not None) and algorithm not in (
                "eagle", "eagle3"):
            raise invalid_argument("--speculative-num-steps and --speculative-eagle-topk go with "
                                   "--speculative-algorithm eagle or eagle3", "speculative_eagle_topk")
        if self.speculative_eagle_topk > 1 and self.speculative_num_draft_tokens < 2:
            raise invalid_argument("--speculative-eagle-topk > 1 needs --speculative-num-draft-tokens >= 2 (the tree's "
                                   "root and at least one draft)", "speculative_num_draft_tokens")
        if self.speculative_draft_model is not None and algorithm not in DRAFT_MODEL_ALGORITHMS:
            raise invalid_argument(f"--speculative-draft-model goes with --speculative-algorithm "
                                   f"{' or '.join(DRAFT_MODEL_ALGORITHMS)} (and only with those)",
                                   "speculative_draft_model")
        _in(self.speculative_draft_load_format, LOAD_FORMATS, "speculative_draft_load_format")
        if not 1 <= self.speculative_ngram_min_match <= self.speculative_ngram_max_match <= MAX_NGRAM_MATCH:
            raise invalid_argument(f"need 1 <= speculative_ngram_min_match <= speculative_ngram_max_match <= "
                                   f"{MAX_NGRAM_MATCH}", "speculative_ngram_min_match")
        if algorithm is not None and self.tp_size > 1:
            raise invalid_argument(f"speculative decoding does not run with tensor parallelism yet (--tp-size "
                                   f"{self.tp_size}): use one or the other", "speculative_algorithm")

    @property
    def speculative_max_drafts(self) -> int:
        """Most drafts per request and step: an EAGLE chain's steps, an EAGLE tree's nodes (the draft tokens less
        the root, at most what its steps can draft), else --speculative-num-draft-tokens."""
        if self.speculative_eagle_topk > 1:
            k, steps = self.speculative_eagle_topk, self.speculative_tree_steps
            return max(1, min(self.speculative_num_draft_tokens - 1, k + (steps - 1) * k * k))
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        return self.speculative_num_draft_tokens

    @property
    def speculative_tree_steps(self) -> int:
        """EAGLE trees: draft steps (the tree's depth); unset: --speculative-num-draft-tokens less the root."""
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        return max(1, self.speculative_num_draft_tokens - 1)

    @property
    def chunk_size(self) -> int:
        """`chunked_prefill_size`, the CPU's default while it is unset (-1: chunking off)."""
        return DEFAULT_CHUNKED_PREFILL if self.chunked_prefill_size is None else self.chunked_prefill_size

    @property
    def prefill_token_budget(self) -> int:
        return self.chunk_size if self.chunk_size > 0 else self.max_prefill_tokens

    @property
    def lora_enabled(self) -> bool:
        """Adapters may be served (--enable-lora or --lora-paths)."""
        return self.enable_lora or bool(self.lora_paths)

    @property
    def chunking_enabled(self) -> bool:
        return self.chunk_size > 0

    def resolve(self) -> EngineConfig:
        """A copy with `device` and `dtype` made concrete."""
        device = self.device
        if device == "auto":
            device = "cuda" if cuda_available() else "cpu"
        dtype = self.dtype
        if dtype == "auto":
            dtype = "float32" if device == "cpu" else "bfloat16"
        backend = self.attention_backend
        if backend == "auto":
            backend = "triton" if device == "cuda" else "torch-native"
        overlap = self.overlap_schedule
        if overlap == "auto":
            overlap = "on" if device == "cuda" else "off"
        return dataclasses.replace(self, device=device, dtype=dtype, overlap_schedule=overlap,
                                   attention_backend=backend)

    @property
    def overlap_enabled(self) -> bool:
        return self.overlap_schedule == "on"

    def mem_fraction(self, device_bytes: int | None) -> float:
        """`mem_fraction_static`, or its default for a GPU of `device_bytes` (None: the CPU)."""
        if self.mem_fraction_static is not None:
            return self.mem_fraction_static
        if device_bytes is not None and device_bytes >= LARGE_GPU_BYTES:
            # 8B on an H100: 455,762 KV tokens vs 423,330 at 0.85; offline 4,017.6 vs 3,955.5 out tok/s
            return LARGE_GPU_MEM_FRACTION
        return DEFAULT_MEM_FRACTION

    def with_device_memory(self, device_bytes: int | None) -> EngineConfig:
        """A copy with the defaults that depend on the device's memory made concrete (None: the CPU)."""
        if self.chunked_prefill_size is not None:
            return self
        return dataclasses.replace(self, chunked_prefill_size=chunk_size_for(device_bytes))

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")
"""Present wherever torch can see a GPU (NVIDIA's driver; ROCm's /dev/kfd)."""


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch where no GPU driver exists (front ends on CPU
    machines then start ~2 s sooner; the scheduler process imports torch anyway)."""
    if not any(os.path.exists(path) for path in GPU_DRIVER_PATHS):
        return False
    import torch

    return bool(torch.cuda.is_available())


def _in(value: str, allowed: tuple[str, ...], name: str) -> None:
    if value not in allowed:
        raise invalid_argument(f"{name} must be one of {', '.join(allowed)} (got {value!r})", name)

