"""Front ends start without torch on a machine without a GPU driver: the services that hold no model
(tokenizer, router, gateway) and the front ends of `serve` and `worker`, whose scheduler processes import
it themselves. torch costs ~2 s of CPU per process start, which a cluster of small services pays many times."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from radixmesh.engine import config as engine_config

FRONT_END_MODULES = ("radixmesh.worker.server", "radixmesh.engine.client", "radixmesh.gateway.local_backend",
                     "radixmesh.gateway.server", "radixmesh.tokenizer_service.server", "radixmesh.router.server",
                     "radixmesh.engine.scheduler.process")


def _imports_torch(code: str) -> bool:
    script = ("import sys\nfrom radixmesh.engine import config\nconfig.GPU_DRIVER_PATHS = ('/nonexistent/gpu',)\n"
              f"{code}\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1] == "True"


def test_front_end_modules_import_no_torch() -> None:
    assert not _imports_torch("\n".join(f"import {m}" for m in FRONT_END_MODULES))


def test_preparing_a_model_and_its_tokenizer_imports_no_torch(default_model_dir: Path) -> None:
    code = ("from radixmesh.engine.config import EngineConfig\nfrom radixmesh.engine.loader import prepare_model\n"
            "from radixmesh.engine.hf_tokenizer import load_tokenizer\n"
            "assert EngineConfig().resolve().device == 'cpu'\n"
            "prepared = prepare_model(None)\nload_tokenizer(prepared.tokenizer_path)")
    assert not _imports_torch(code)


def test_cuda_available_asks_torch_where_a_driver_may_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(engine_config, "GPU_DRIVER_PATHS", (str(tmp_path / "absent"),))
    assert engine_config.cuda_available() is False
    monkeypatch.setattr(engine_config, "GPU_DRIVER_PATHS", (str(tmp_path),))
    assert engine_config.cuda_available() is torch.cuda.is_available()


def test_an_unknown_attention_backend_fails_when_the_config_is_built_without_torch() -> None:
    code = ("from radixmesh.common.errors import RadixMeshError\nfrom radixmesh.engine.config import EngineConfig\n"
            "EngineConfig(attention_backend='torch_native')\n"
            "try:\n    EngineConfig(attention_backend='nope')\n    raise SystemExit('accepted')\n"
            "except RadixMeshError as exc:\n    assert 'unknown attention backend' in exc.message, exc.message")
    assert not _imports_torch(code)
