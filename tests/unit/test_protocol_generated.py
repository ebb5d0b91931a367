"""The committed code under services/radixmesh/protocol/ is what scripts/gen_proto.sh makes from proto/."""

from __future__ import annotations

import filecmp
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "services" / "radixmesh" / "protocol"


def _generated(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.endswith((".py", ".pyi")) and "_pb2" in p.name}


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools is not installed")
def test_committed_protocol_code_is_fresh(tmp_path: Path) -> None:
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], capture_output=True,
                            text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=120)
    assert result.returncode == 0, result.stderr
    fresh, committed = _generated(tmp_path), _generated(PROTOCOL)
    assert fresh, "gen_proto.sh produced nothing"
    assert fresh == committed, f"files differ: run `bash scripts/gen_proto.sh` ({sorted(fresh ^ committed)})"
    stale = [name for name in sorted(fresh) if not filecmp.cmp(tmp_path / name, PROTOCOL / name, shallow=False)]
    assert not stale, f"stale generated code, run `bash scripts/gen_proto.sh`: {stale}"


def test_every_proto_has_generated_messages() -> None:
    protos = sorted((ROOT / "proto" / "radixmesh" / "v1").glob("*.proto"))
    assert protos
    for proto in protos:
        assert (PROTOCOL / f"{proto.stem}_pb2.py").exists(), f"{proto.name} has no generated module"


def test_generated_modules_import_as_radixmesh_protocol() -> None:
    from radixmesh.protocol import router_pb2_grpc, tokenizer_pb2_grpc, worker_pb2, worker_pb2_grpc

    request = worker_pb2.GenerateRequest(request_id="r", token_ids=[1, 2, 3])
    assert worker_pb2.GenerateRequest.FromString(request.SerializeToString()) == request
    assert hasattr(worker_pb2_grpc, "WorkerServiceStub")
    assert hasattr(router_pb2_grpc, "RouterServiceStub")
    assert hasattr(tokenizer_pb2_grpc, "TokenizerServiceStub")

