"""Images over HTTP on real processes: `radixmesh serve`, and the services (tokenizer -> worker, behind
`radixmesh gateway`) on a tiny Qwen2-VL. Chat `image_url` parts and native `image_data` generate; a
repeated image is served from the cache; every bad image is a 400 naming its part; /model_info says
the model understands images."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest

from radixmesh.protocol import multimodal_pb2, sampling_pb2, worker_pb2, worker_pb2_grpc
from radixmesh.wire.images import image_pad_ids
from tests import mm_factory as mf
from tests.integration.service_procs import start_service, stop_all, wait_all_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
LIMITS = ["--max-images-per-request", "2", "--max-image-pixels", str(200 * 200)]
ENGINE = ["--device", "cpu", "--max-total-tokens", "4096", "--max-running-requests", "4"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("mm-http")
    return mf.qwen2_vl_dir(mf.tokenizer_dir(mf.default_tokenizer_source(), base / "tok"), base / "qwen2_vl")


@pytest.fixture(scope="module")
def servers(model_dir: Path) -> Iterator[dict[str, str]]:
    model = ["--model", str(model_dir)]
    # started together: each service waits for what it needs
    serve = start_service("serve", [*model, *ENGINE, *LIMITS], http=True, wait_ready=False)
    tokenizer = start_service("tokenizer", [*model, *LIMITS, "--metrics-port", "0"], wait_ready=False)
    worker = start_service("worker", [*model, *ENGINE, "--metrics-port", "0"], wait_ready=False)
    gateway = start_service("gateway", ["--worker", worker.address, "--tokenizer", tokenizer.address], http=True,
                            wait_ready=False)
    procs = [serve, tokenizer, worker, gateway]
    wait_all_ready(procs)
    try:
        yield {"serve": serve.address, "services": gateway.address, "worker": worker.address}
    finally:
        stop_all(procs[::-1])


@pytest.fixture(scope="module", params=["serve", "services"])  # HTTP front ends
def http(request: pytest.FixtureRequest, servers: dict[str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=servers[request.param], timeout=120) as client:
        yield client


def _chat(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(parts)}], "temperature": 0, "max_tokens": 6, **extra}


def _image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


TEXT = {"type": "text", "text": "What is in this picture?"}


def test_chat_with_an_image_generates_and_a_repeat_is_cached(http: httpx.Client) -> None:
    http.post("/flush_cache")
    body = _chat(_image_part(mf.data_url(mf.image_png(5, 120, 90))), TEXT)
    first, again = http.post("/v1/chat/completions", json=body), http.post("/v1/chat/completions", json=body)
    assert first.status_code == again.status_code == 200, first.text
    usage, usage_again = first.json()["usage"], again.json()["usage"]
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage_again["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert first.json()["choices"][0]["message"] == again.json()["choices"][0]["message"]


def test_serve_and_the_services_answer_alike(servers: dict[str, str]) -> None:
    body = _chat(TEXT, _image_part(mf.data_url(mf.image_png(6, 64, 64))), TEXT)
    answers = [httpx.post(f"{servers[name]}/v1/chat/completions", json=body, timeout=120).json()
               for name in ("serve", "services")]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    assert answers[0]["usage"]["prompt_tokens"] == answers[1]["usage"]["prompt_tokens"]


def test_native_generate_takes_image_data(http: httpx.Client) -> None:
    png = mf.image_png(7, 56, 56)
    for image in (base64.b64encode(png).decode(), [mf.data_url(png)]):
        response = http.post("/generate", json={"text": f"{IMAGE}Describe it.", "image_data": image,
                                                "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
        assert response.status_code == 200, response.text
        assert len(response.json()["output_ids"]) == 3


def test_model_info_reports_image_understanding(http: httpx.Client) -> None:
    assert http.get("/model_info").json()["has_image_understanding"] is True


def _b64(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


BAD = [
    ("not-an-image", _chat(_image_part(_b64(b"just some text")), TEXT), "messages[0].content[0].image_url",
     "not an image"),
    ("broken-base64", _chat(TEXT, _image_part("data:image/png;base64,@@@###")), "messages[0].content[1].image_url",
     "broken base64"),
    ("too-many-images", _chat(*[_image_part(mf.data_url(mf.image_png(i, 30, 30))) for i in range(3)]),
     "messages[0].content[2].image_url", "3 images"),
    ("too-many-pixels", _chat(_image_part(mf.data_url(mf.image_png(1, 300, 300)))),
     "messages[0].content[0].image_url", "pixels"),
    ("remote-url-not-allowed", _chat(_image_part("http://127.0.0.1:9/cat.png")), "messages[0].content[0].image_url",
     "--allow-remote-images"),
    ("image-url-without-url", _chat({"type": "image_url", "image_url": {"url": ""}}),
     "messages[0].content[0].image_url", "url"),
]


@pytest.mark.parametrize(("case", "body", "param", "mention"), BAD, ids=[b[0] for b in BAD])
def test_bad_images_are_400s_naming_the_part(http: httpx.Client, case: str, body: dict[str, Any], param: str,
                                             mention: str) -> None:
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and mention in error["message"], error


@pytest.mark.parametrize(("body", "param", "mention"), [
    ({"text": "No placeholder here.", "image_data": mf.data_url(mf.image_png(1))}, "text", "image placeholder"),
    ({"text": f"{IMAGE}{IMAGE}Two?", "image_data": [mf.data_url(mf.image_png(1))]}, "text", "2 image placeholders"),
    ({"text": f"{IMAGE}x", "image_data": 5}, "image_data", "base64"),
    ({"text": [f"{IMAGE}x", "y"], "image_data": [mf.data_url(mf.image_png(1))]}, "image_data", "one entry per"),
], ids=["no-placeholder", "placeholder-count", "image-data-not-a-string", "batch-count"])
def test_bad_native_image_requests_are_400s(http: httpx.Client, body: dict[str, Any], param: str,
                                            mention: str) -> None:
    response = http.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and mention in error["message"], error


def _worker_request(image: multimodal_pb2.ImageInput, ids: list[int]) -> worker_pb2.GenerateRequest:
    params = sampling_pb2.SamplingParams(max_new_tokens=2, temperature=0)
    return worker_pb2.GenerateRequest(token_ids=ids, sampling_params=params, images=[image])


def test_worker_checks_images_before_its_scheduler_sees_them(servers: dict[str, str]) -> None:
    """Malformed images on the internal contract are INVALID_ARGUMENT naming `images`, and the worker keeps serving."""
    patches = np.zeros((16, 3 * 2 * 14 * 14), np.float32)  # a 4x4 patch grid: 4 merged tokens
    good = multimodal_pb2.ImageInput(content_hash=5, offset=2, num_tokens=4, pixel_values=patches.tobytes(),
                                     pixel_shape=list(patches.shape), grid_thw=[1, 4, 4])
    ids = [10, 11, *image_pad_ids(5, 4), 12]
    bad = {
        "pad ids": (good, [10, 11, *image_pad_ids(6, 4), 12]),
        "tokens": (_replace(good, num_tokens=3), [10, 11, *image_pad_ids(5, 3), 12]),
        "shape": (_replace(good, pixel_shape=[16, 100]), ids),
        "bytes": (_replace(good, pixel_values=b"\0" * 12), ids),
    }
    with grpc.insecure_channel(servers["worker"]) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        for name, (image, prompt) in bad.items():
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(_worker_request(image, prompt), timeout=60))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert "images" in (caught.value.details() or ""), (name, caught.value.details())
        replies = list(stub.Generate(_worker_request(good, ids), timeout=60))
    assert sum(len(r.token_ids) for r in replies) == 2


def _replace(image: multimodal_pb2.ImageInput, **fields: Any) -> multimodal_pb2.ImageInput:
    copy = multimodal_pb2.ImageInput()
    copy.CopyFrom(image)
    for key, value in fields.items():
        if isinstance(value, list):
            del getattr(copy, key)[:]
            getattr(copy, key).extend(value)
        else:
            setattr(copy, key, value)
    return copy
