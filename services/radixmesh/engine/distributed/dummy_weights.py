"""Random weights for a tensor-parallel rank: the same whole model as `init_dummy_` gives at TP 1.

Each rank generates every whole tensor in turn on its own device, with `init_dummy_`'s generator
and order, and keeps its shard (`CausalLM.load_weights` cuts it); one whole tensor at a time is
alive, never the whole model. TP N and TP 1 therefore run the same model, so their outputs agree.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import STACKED_PARAMS
from radixmesh.engine.models.registry import model_class

_UNSTACKED: dict[str, list[str]] = {}
for _piece, (_stacked, _index) in STACKED_PARAMS.items():
    _UNSTACKED.setdefault(_stacked, []).insert(_index, _piece)


def iter_whole_dummy_weights(config: ModelConfig, seed: int, device: torch.device,
                             dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """`(checkpoint name, whole tensor)` of the TP 1 model `init_dummy_(model, seed)` would fill."""
    with torch.device("meta"):
        whole = model_class(config.family)(config)
    split = getattr(whole, "split_checkpoint_tensor", None)  # families with stacked parameters of their own
    generator: torch.Generator | None = None
    for name, param in whole.named_parameters():
        tensor = torch.empty(param.shape, dtype=dtype, device=device)
        if tensor.dim() >= 2:
            if generator is None:
                generator = torch.Generator(device=device)
                generator.manual_seed(seed)
            tensor.normal_(0.0, 0.02, generator=generator)
        elif name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            tensor.zero_()
        pieces = split(name, tensor) if split is not None else None
        yield from pieces if pieces is not None else _unstack(name, tensor, config)


def _unstack(name: str, tensor: torch.Tensor, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked parameter (qkv_proj, gate_up_proj) as the checkpoint tensors it is made of."""
    module_path, _, leaf = name.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    pieces = _UNSTACKED.get(module)
    if pieces is None:
        yield name, tensor
        return
    d, inter = config.head_dim, config.intermediate_size
    sizes = ([config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d] if module == "qkv_proj"
             else [inter, inter])
    for piece, part in zip(pieces, torch.split(tensor, sizes, dim=0)):
        yield f"{parent}.{piece}.{leaf}", part
