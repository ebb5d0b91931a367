"""API keys: several (a flag, a file, a mounted Secret directory), the same check on HTTP (401) and
gRPC (UNAUTHENTICATED), health open, keys read again when the file changes, and never logged."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.gateway.auth import ApiKeys, api_keys_of, read_keys
from radixmesh.gateway.config import GatewayConfig
from radixmesh.protocol import common_pb2
from radixmesh.protocol import inference_pb2 as pb
from tests.unit.grpc_api_harness import error_detail, gateway
from tests.unit.test_grpc_api import list_services

FLAG_KEY = "sk-flag-0123456789"
FILE_KEYS = ("sk-file-aaaaaaaaaa", "sk-file-bbbbbbbbbb")
WRONG = "sk-wrong-cccccccccc"


def _key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text(f"# API keys, one per line\n{FILE_KEYS[0]}\n\n  {FILE_KEYS[1]}  \n")
    return path


def _bearer(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


def test_key_file_and_secret_directory(tmp_path: Path) -> None:
    assert read_keys(str(_key_file(tmp_path))) == list(FILE_KEYS)
    secret = tmp_path / "secret"  # what the kubelet mounts: files linked into a hidden ..data directory
    data = secret / "..2026_01_01"
    data.mkdir(parents=True)
    (data / "primary").write_text(FILE_KEYS[0])
    (data / "rotating").write_text(FILE_KEYS[1] + "\n")
    (secret / "..data").symlink_to(data.name)
    for name in ("primary", "rotating"):
        (secret / name).symlink_to(f"..data/{name}")
    assert read_keys(str(secret)) == list(FILE_KEYS)


def test_bad_key_sources_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(RadixMeshError, match="cannot read") as missing:
        ApiKeys(key_file=str(tmp_path / "absent"))
    assert missing.value.param == "api_key_file"
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(RadixMeshError, match="holds no key"):
        ApiKeys(key_file=str(empty))
    with pytest.raises(RadixMeshError, match="must not be empty"):
        ApiKeys([" "])


def test_check_accepts_every_key_and_nothing_else(tmp_path: Path) -> None:
    keys = ApiKeys([FLAG_KEY], str(_key_file(tmp_path)))
    assert keys.num_keys == 3
    for key in (FLAG_KEY, *FILE_KEYS):
        assert keys.check(f"Bearer {key}", "x") is None
        assert keys.check(f"bearer {key}".encode(), "x") is None
    for given in (f"Bearer {WRONG}", f"Basic {FLAG_KEY}", FLAG_KEY, "Bearer ", f"Bearer {FLAG_KEY}x", ""):
        error = keys.check(given, "x")
        assert error is not None and error.code is ErrorCode.UNAUTHENTICATED
        assert error.message == "Incorrect API key provided"
    missing = keys.check(None, "metadata 'authorization: Bearer <key>'")
    assert missing is not None and "authorization: Bearer <key>" in missing.message


def test_key_file_is_read_again_when_rotated(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _key_file(tmp_path)
    keys = ApiKeys(key_file=str(path), reload_interval_s=0.0)
    path.write_text("sk-new-dddddddddd\n")
    assert keys.check("Bearer sk-new-dddddddddd", "x") is None
    assert keys.check(f"Bearer {FILE_KEYS[0]}", "x") is not None  # the old key no longer works
    path.unlink()  # a Secret being swapped: the keys read before stay
    with caplog.at_level(logging.WARNING):
        assert keys.check("Bearer sk-new-dddddddddd", "x") is None
    assert "cannot be read" in caplog.text and "sk-new" not in caplog.text


def test_http_and_grpc_refuse_missing_and_wrong_keys(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = GatewayConfig(grpc_port=0, api_key=FLAG_KEY, api_key_file=str(_key_file(tmp_path)))
    assert FLAG_KEY not in repr(config)

    async def run() -> None:
        async with gateway(config=config) as gw:
            body = {"prompt": "hi", "max_tokens": 2}
            assert (await gw.http.post("/v1/completions", json=body)).status_code == 401
            wrong = await gw.http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {WRONG}"})
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
            assert (await gw.http.get("/health")).status_code == 200
            request = pb.CompleteRequest(text="hi", options=pb.GenerationOptions(max_tokens=2))
            for metadata, says in (((), "Missing API key"), (_bearer(WRONG), "Incorrect API key")):
                for call in (gw.stub.Complete(request, metadata=metadata),
                             gw.stub.ListModels(pb.ListModelsRequest(), metadata=metadata)):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await call
                    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert says in (caught.value.details() or "")
                    assert error_detail(caught.value).code == common_pb2.ERROR_CODE_UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await list_services(gw.channel, metadata)  # reflection needs the key too
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                stream = gw.stub.StreamChat(pb.ChatRequest(messages=[pb.ChatTurn(role="user", content="x")]),
                                            metadata=metadata)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stream.read()
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(gw.channel)  # probes need no key
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == \
                health_pb2.HealthCheckResponse.SERVING
            for key in (FLAG_KEY, *FILE_KEYS):
                reply = await gw.stub.Complete(request, metadata=_bearer(key))
                assert reply.choices[0].text
                ok = await gw.http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
                assert ok.status_code == 200
            assert "radixmesh.v1.InferenceService" in await list_services(gw.channel, _bearer(FILE_KEYS[1]))

    with caplog.at_level(logging.DEBUG):
        asyncio.run(run())
    for secret in (FLAG_KEY, *FILE_KEYS, WRONG):
        assert secret not in caplog.text


def test_no_keys_means_open() -> None:
    assert api_keys_of(GatewayConfig()) is None


def test_server_info_says_keys_are_set_without_showing_them(tmp_path: Path) -> None:
    config = GatewayConfig(grpc_port=0, api_key_file=str(_key_file(tmp_path)))

    async def run() -> None:
        async with gateway(config=config) as gw:
            response = await gw.http.get("/server_info", headers={"Authorization": f"Bearer {FILE_KEYS[1]}"})
            assert response.status_code == 200
            info = response.json()
            assert info["api_key_set"] is True and info["grpc_port"] == 0 and info["tls"] is False
            assert all(key not in response.text for key in FILE_KEYS)

    asyncio.run(run())
