"""Giving a module built on the meta device its storage, and copying checkpoint tensors into its parameters by
name (vision towers, projectors)."""

from __future__ import annotations

import torch
from torch import nn


def materialize(module: nn.Module, device: torch.device) -> nn.Module:
    """What `module.to_empty(device=device)` does (uninitialized storage of every parameter's and buffer's
    shape, strides and dtype), allocated directly: `empty_like` of a meta tensor runs torch's Python meta
    kernels, whose first call imports sympy, half a second of CPU in every process that loads a model."""
    return module._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))


class ParamLoader:
    """Loads tensors into `module`'s parameters by name, except those under `skip` (loaded elsewhere);
    `check_complete` names what is missing."""

    def __init__(self, module: nn.Module, skip: str | None = None) -> None:
        self.params = {name: p for name, p in module.named_parameters() if skip is None or not name.startswith(skip)}
        self.loaded: set[str] = set()

    def load(self, name: str, tensor: torch.Tensor) -> None:
        dest = self.params.get(name)
        if dest is None:
            raise ValueError(f"checkpoint has unexpected weight {name!r}")
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor)
        self.loaded.add(name)

    def check_complete(self) -> None:
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[0]!r}")


def rename_prefix(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """`name` with the first matching old prefix replaced by its new one."""
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old):]
    return name
