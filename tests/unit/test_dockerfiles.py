"""The images build from what pyproject.toml packages (no Docker engine here: checked by reading)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = [REPO / "docker" / "worker.Dockerfile", REPO / "docker" / "service.Dockerfile"]


def _source_dirs() -> set[str]:
    """Top-level directories holding the packages pyproject.toml installs."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    package_dir: dict[str, str] = project["tool"]["setuptools"].get("package-dir", {})
    dirs = set()
    for package in project["tool"]["setuptools"]["packages"]:
        parts = package.split(".")
        for depth in range(len(parts), 0, -1):  # longest mapped prefix wins, as in setuptools
            prefix = ".".join(parts[:depth])
            if prefix in package_dir:
                dirs.add(package_dir[prefix].split("/")[0])
                break
        else:
            dirs.add(parts[0])
    return dirs


def _copied(text: str) -> set[str]:
    copied = set()
    for line in text.splitlines():
        match = re.match(r"^COPY\s+(?!--from)(.+)\s+\S+$", line.strip())
        if match:
            copied |= {src.rstrip("/") for src in match.group(1).split()}
    return copied


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_every_packaged_directory(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    copied = _copied(text)
    missing = (_source_dirs() | {"pyproject.toml", "README.md"}) - copied
    assert not missing, f"{dockerfile.name} does not COPY {sorted(missing)}"
    for path in copied:
        assert (REPO / path).exists(), f"{dockerfile.name} copies {path}, which does not exist"
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert not copied & ignored, f".dockerignore drops {copied & ignored} that {dockerfile.name} copies"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_runs_radixmesh_as_the_charts_user(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    assert 'ENTRYPOINT ["radixmesh"]' in text
    assert "USER 1000:1000" in text  # podSecurityContext.runAsUser/runAsGroup in values.yaml
    assert "--uid 1000" in text


def test_worker_image_is_cuda_with_the_gpu_extra() -> None:
    text = DOCKERFILES[0].read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+$", text, re.M)
    assert 'pip install ".[gpu]"' in text
    assert re.search(r"^ARG NIXL_PACKAGE=nixl-cu12>=", text, re.M)  # the nixl KV transport, for the image's CUDA 12
