"""Stream `(hf_name, tensor)` pairs out of a Hugging Face safetensors directory."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from radixmesh.common.errors import invalid_argument, not_found

if TYPE_CHECKING:
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def iter_safetensors_weights(model_dir: str | Path,
                             progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of the checkpoint as a CPU tensor, shard by shard.

    Reads `model.safetensors`, or the shards named by `model.safetensors.index.json`, or
    else every `*.safetensors` file in the directory. A progress bar over shards is shown
    on stderr when there are several. Failures raise RadixMeshError with one line.
    """
    files = safetensors_files(model_dir)
    bar = tqdm(files, desc="radixmesh: loading shards", unit="shard", file=sys.stderr,
               disable=not progress or len(files) < 2, leave=False)
    for file in bar:
        yield from _iter_file(file)


def iter_safetensors_slices(model_dir: str | Path,
                            progress: bool = True) -> Iterator[tuple[str, SafetensorsSlice]]:
    """Like `iter_safetensors_weights`, but each tensor is a lazy handle that reads only the slice
    asked for (a tensor-parallel rank reads its shard of the checkpoint, not the whole of it)."""
    files = safetensors_files(model_dir)
    bar = tqdm(files, desc="radixmesh: loading shards", unit="shard", file=sys.stderr,
               disable=not progress or len(files) < 2, leave=False)
    for file in bar:
        yield from _iter_file_slices(file)


class SafetensorsSlice:
    """One checkpoint tensor, read on demand: `narrow(dim, start, length)` reads just that slice."""

    def __init__(self, path: Path, name: str, handle: Any) -> None:
        self.path, self.name, self._handle = path, name, handle
        self.shape = tuple(handle.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        from safetensors import SafetensorError

        index = (slice(None),) * dim + (slice(start, start + length),)
        try:
            tensor: torch.Tensor = self._handle[index]
        except (SafetensorError, OSError, ValueError) as exc:
            raise invalid_argument(f"corrupt safetensors file {self.path}: tensor {self.name}: {exc}") from None
        return tensor


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint files of `model_dir`, in load order; errors name what is missing."""
    root = Path(model_dir)
    if not root.is_dir():
        raise not_found(f"model directory {root} not found")
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    if (root / INDEX_FILE).is_file():
        return _indexed_shards(root)
    files = sorted(root.glob("*.safetensors"))
    if files:
        return files
    has_bin = any(root.glob("*.bin")) or any(root.glob("*.pt"))
    hint = " (.bin/.pt checkpoints are not supported; convert them to safetensors)" if has_bin else ""
    raise not_found(f"no safetensors weights in {root}{hint}")


def _indexed_shards(root: Path) -> list[Path]:
    index_path = root / INDEX_FILE
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise invalid_argument(f"corrupt safetensors index {index_path}: {exc!r}") from None
    shards = [root / name for name in names]
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        raise not_found(f"safetensors shard {missing[0]} listed in {index_path} is missing "
                        f"({len(missing)} of {len(shards)} missing)")
    return shards


def _iter_file(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise invalid_argument(f"corrupt safetensors file {path}: {first}") from None


def _iter_file_slices(path: Path) -> Iterator[tuple[str, SafetensorsSlice]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, SafetensorsSlice(path, name, f.get_slice(name))
    except (SafetensorError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise invalid_argument(f"corrupt safetensors file {path}: {first}") from None
