"""LoRA adapters over the HTTP API of `radixmesh serve` (a real scheduler process on a tiny random Llama): listed
in /v1/models, named as `model: "base:adapter"` / `"adapter"` or `lora_path`, loaded and unloaded at run time,
bad input answered with 404 / 400 naming the problem; tokens equal Hugging Face PEFT's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ..unit.lora_factory import peft_greedy, write_random_adapter
from ..unit.test_lora_adapter import write_adapter
from ..unit.tp_factory import write_tiny_checkpoint
from .service_procs import start_service, stop_all, wait_all_ready

pytest.importorskip("peft")
pytestmark = [pytest.mark.integration]
PROMPT = [5, 17, 3, 99, 42, 8, 61]
MAX_NEW = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("lora-api")
    model = write_tiny_checkpoint(root / "tiny")
    r8 = write_random_adapter(model, root / "r8", rank=8, seed=1)
    r16 = write_random_adapter(model, root / "r16", rank=16, seed=2, targets=["q_proj", "v_proj"])
    paths = {"model": model, "r8": r8, "r16": r16, "r64": write_adapter(root / "r64", 64),
             "other": write_adapter(root / "other", 8, hidden=32)}
    serve = start_service("serve", ["--model", str(model), "--served-model-name", "tiny", "--device", "cpu",
                                    "--max-total-tokens", "2048", "--lora-paths", f"r8={r8}", "--max-lora-rank", "16",
                                    "--max-loras-per-batch", "2"], http=True, wait_ready=False)
    try:
        want = {name: peft_greedy(model, paths[name] if name else None, PROMPT, MAX_NEW)
                for name in (None, "r8", "r16")}
        wait_all_ready([serve])
        with httpx.Client(base_url=serve.address, timeout=120) as client:
            yield client, {"paths": paths, "want": want}
    finally:
        stop_all([serve])


def _generate(client: httpx.Client, lora: str | None) -> Any:
    return client.post("/generate", json={"input_ids": PROMPT, "lora_path": lora, "sampling_params": {
        "max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}})


def _complete(client: httpx.Client, model: str) -> Any:
    return client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": MAX_NEW,
                                                "temperature": 0, "ignore_eos": True, "logprobs": 0})


def test_models_and_requests_name_adapters(setup: tuple[httpx.Client, dict[str, Any]]) -> None:
    client, ctx = setup
    models = client.get("/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("r8", "tiny")]
    assert _generate(client, "r8").json()["output_ids"] == ctx["want"]["r8"]
    assert _generate(client, None).json()["output_ids"] == ctx["want"][None]
    for name in ("tiny:r8", "r8"):
        reply = _complete(client, name)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == name


def test_load_unload_at_run_time(setup: tuple[httpx.Client, dict[str, Any]]) -> None:
    client, ctx = setup
    reply = client.post("/load_lora_adapter", json={"lora_name": "r16", "lora_path": str(ctx["paths"]["r16"])})
    assert reply.status_code == 200 and reply.json()["rank"] == 16, reply.text
    assert _generate(client, "r16").json()["output_ids"] == ctx["want"]["r16"]
    assert "r16" in [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert client.post("/unload_lora_adapter", json={"lora_name": "r16"}).status_code == 200
    gone = _generate(client, "r16")
    assert gone.status_code == 404 and "r16" in gone.text


def test_bad_adapters_are_refused_naming_the_problem(setup: tuple[httpx.Client, dict[str, Any]]) -> None:
    client, ctx = setup
    unknown = _complete(client, "tiny:nope")
    assert unknown.status_code == 404 and "nope" in unknown.text
    big = client.post("/load_lora_adapter", json={"lora_name": "big", "lora_path": str(ctx["paths"]["r64"])})
    assert big.status_code == 400 and "rank 64" in big.text and "16" in big.text
    other = client.post("/load_lora_adapter", json={"lora_name": "o", "lora_path": str(ctx["paths"]["other"])})
    assert other.status_code == 400 and "another base model" in other.text
    again = client.post("/load_lora_adapter", json={"lora_name": "r8", "lora_path": str(ctx["paths"]["r8"])})
    assert again.status_code == 400 and "already loaded" in again.text
    assert client.post("/unload_lora_adapter", json={"lora_name": "nope"}).status_code == 404


def test_per_adapter_series(setup: tuple[httpx.Client, dict[str, Any]]) -> None:
    """The dashboard's per-adapter series on `serve`: tokens and finished sequences by adapter, each loaded
    adapter's running and waiting sequences."""
    from prometheus_client.parser import text_string_to_metric_families

    client, _ = setup
    assert _generate(client, "r8").status_code == 200
    samples = {(s.name, s.labels.get("adapter"), s.labels.get("state")): s.value
               for f in text_string_to_metric_families(client.get("/metrics").text) if "lora" in f.name
               for s in f.samples}
    assert samples[("radixmesh_lora_generation_tokens_total", "r8", None)] >= MAX_NEW
    assert samples[("radixmesh_lora_requests_finished_total", "r8", None)] >= 1
    assert samples[("radixmesh_lora_adapter_requests", "r8", "running")] == 0
    assert ("radixmesh_lora_adapter_requests", "r8", "waiting") in samples
    assert samples[("radixmesh_lora_adapters_loaded", None, None)] >= 1
