"""Images over HTTP on real processes: `radixmesh serve`, and the services (tokenizer -> worker, behind
`radixmesh gateway`) on a tiny Qwen2-VL. Chat `image_url` parts and native `image_data` generate; a
repeated image is served from the cache; every bad image is a 400 naming its part; /model_info says
the model understands images."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import mm_factory as mf
from tests.integration.service_procs import ServiceProc, start_service

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
    procs: list[ServiceProc] = []
    try:
        procs.append(start_service("serve", [*model, *ENGINE, *LIMITS], http=True))
        tokenizer = start_service("tokenizer", [*model, *LIMITS, "--metrics-port", "0"])
        worker = start_service("worker", [*model, *ENGINE, "--metrics-port", "0"])
        procs += [tokenizer, worker]
        gateway = ["--worker", worker.address, "--tokenizer", tokenizer.address]
        procs.append(start_service("gateway", gateway, http=True))
        yield {"serve": procs[0].address, "services": procs[-1].address}
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture(scope="module", params=["serve", "services"])
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
    answers = [httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json() for url in servers.values()]
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
