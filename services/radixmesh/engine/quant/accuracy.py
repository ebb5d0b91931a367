"""FP8 against the unquantized model on the same weights: next-token logits of many prompts, compared.

    radixmesh bench fp8-accuracy [--model ...] [--load-format dummy] [--num-prompts 100] [--kv-cache-dtype ...]

Both models are built by `ModelRunner` (so the FP8 one runs the real kernels on a GPU and the reference
path on the CPU). The FP8 model loads the reference model's own weights, through the same path as a
bf16 checkpoint (quantized at load), so random weights compare too. Prompts are random token ids (or
given), run as one extend pass; per prompt we compare the last position's logits: cosine similarity,
top-1 agreement, and whether FP8's top-1 is among the reference's top 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Iterator
from typing import Any

import torch

from radixmesh.engine.attention.base import ForwardBatch, ForwardMode
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import STACKED_PARAMS


def checkpoint_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters under their checkpoint names: stacked q/k/v and gate/up split back."""
    config = model.config
    assert isinstance(config, ModelConfig), f"{type(model).__name__} carries no ModelConfig"
    sizes = {"qkv_proj": [config.num_heads * config.head_dim] + [config.num_kv_heads * config.head_dim] * 2,
             "gate_up_proj": [config.intermediate_size] * 2}
    split = getattr(model, "split_checkpoint_tensor", None)  # families with stacked parameters of their own (MoE)
    for name, param in model.named_parameters():
        pieces = split(name, param.detach()) if split is not None else None
        if pieces is not None:
            yield from pieces
            continue
        _, _, rest = name.partition(".layers.")
        module_path, _, leaf = name.rpartition(".")
        stacked = module_path.rpartition(".")[2]
        if rest and stacked in sizes:
            sources = sorted((shard, src) for src, (target, shard) in STACKED_PARAMS.items() if target == stacked)
            for (_, src), part in zip(sources, param.detach().split(sizes[stacked])):
                yield f"{module_path.rpartition('.')[0]}.{src}.{leaf}", part
        else:
            yield name, param.detach()


@torch.inference_mode()
def prefill_logits(runner: Any, prompts: list[list[int]]) -> torch.Tensor:
    """Float32 logits `[len(prompts), vocab]` of each prompt's last token, from one extend pass (no cache)."""
    num_tokens = sum(len(p) for p in prompts)
    slots = runner.allocator.alloc(num_tokens)
    rows = runner.req_pool.alloc(len(prompts))
    assert slots is not None and rows is not None, "prompts do not fit the KV pool"
    ids: list[int] = []
    positions: list[int] = []
    start = 0
    for row, prompt in zip(rows, prompts):
        runner.req_pool.req_to_token[row, :len(prompt)] = slots[start:start + len(prompt)]
        ids += prompt
        positions += range(len(prompt))
        start += len(prompt)
    lens = [len(p) for p in prompts]

    def dev(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=runner.device)

    fb = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=dev(ids), positions=dev(positions), out_cache_loc=slots,
                      req_pool_indices=dev(rows), seq_lens=dev(lens), extend_prefix_lens=dev([0] * len(lens)),
                      extend_seq_lens=dev(lens), req_to_token_pool=runner.req_pool, token_to_kv_pool=runner.kv_pool,
                      attn_backend=runner.attn_backend, seq_lens_cpu=lens, extend_prefix_lens_cpu=[0] * len(lens),
                      extend_seq_lens_cpu=lens, req_pool_indices_cpu=rows)
    runner.attn_backend.init_forward_metadata(fb)
    logits: torch.Tensor = runner.model(fb.input_ids, fb.positions, fb).float()
    runner.allocator.free(slots)
    runner.req_pool.free(rows)
    return logits


def compare_logits(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    """Per-prompt cosine (min, mean), top-1 agreement, and got's top-1 within ref's top 3."""
    cos = torch.nn.functional.cosine_similarity(ref, got, dim=-1)
    top1 = got.argmax(-1)
    in_top3 = (ref.topk(3, dim=-1).indices == top1[:, None]).any(-1)
    top2 = ref.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]) / ref.std(dim=-1)
    return {"cosine_min": round(float(cos.min()), 5), "cosine_mean": round(float(cos.mean()), 5),
            "top1_agreement": round(float((ref.argmax(-1) == top1).float().mean()), 4),
            "top1_in_ref_top3": round(float(in_top3.float().mean()), 4),
            "ref_top2_margin_over_std_median": round(float(statistics.median(margin.tolist())), 4)}


def random_prompts(num: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


def compare_fp8(ref_runner: Any, fp8_runner: Any, prompts: list[list[int]]) -> dict[str, float]:
    """Load `ref_runner`'s weights into `fp8_runner` (quantized at load), and compare their logits."""
    fp8_model = fp8_runner.model
    weights = checkpoint_weights(ref_runner.model)
    fp8_model.load_weights(fp8_runner.quant.adapt_weights(fp8_model, weights) if fp8_runner.quant is not None
                           else weights)
    return compare_logits(prefill_logits(ref_runner, prompts), prefill_logits(fp8_runner, prompts))


def cmd_fp8_accuracy(args: argparse.Namespace) -> int:
    from radixmesh.engine.args import engine_kwargs
    from radixmesh.engine.config import EngineConfig
    from radixmesh.engine.loader import prepare_model
    from radixmesh.engine.model_runner import ModelRunner

    kwargs = engine_kwargs(args)
    kwargs.update(model=args.model_shape or args.model, disable_cuda_graph=True)
    ref_config = EngineConfig(**{**kwargs, "quantization": None, "kv_cache_dtype": "auto"}).resolve()
    prepared = prepare_model(ref_config.model, ref_config.load_format, lend_tokenizer=False)
    ref = ModelRunner(ref_config, prepared)
    fp8_config = dataclasses.replace(ref_config, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                                     load_format="dummy")
    fp8 = ModelRunner(fp8_config, dataclasses.replace(prepared, load_format="dummy"))
    prompts = random_prompts(args.num_prompts, prepared.config.vocab_size, args.min_len, args.max_len, args.seed)
    result = {"bench": "fp8-accuracy", "model": prepared.name, "load_format": ref_config.load_format,
              "device": str(ref.device), "dtype": ref_config.dtype, "quantization": args.quantization,
              "kv_cache_dtype": args.kv_cache_dtype, "num_prompts": len(prompts),
              **compare_fp8(ref, fp8, prompts), "command": " ".join(sys.argv)}
    if ref.device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    line = json.dumps(result)
    print(line)
    if args.result_file:
        with open(args.result_file, "a") as fh:
            fh.write(line + "\n")
    return 0
