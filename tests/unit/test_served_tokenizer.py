"""Where clients find the served tokenizer: the cluster gateway's model card, and `bench serving`'s lookup."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from loadtests import server_info
from loadtests.__main__ import main as bench_main
from loadtests.fakes import FakeServer, running_fake_server
from radixmesh.gateway.model_card import make_card
from radixmesh.protocol import tokenizer_pb2, worker_pb2


def test_cluster_card_carries_the_tokenizer_services_path() -> None:
    info = worker_pb2.GetModelInfoResponse(model_name="m", model_path="/models/m", context_len=2048, vocab_size=300,
                                           max_running_requests=8, engine_config_json='{"tokenizer": null, "dtype": '
                                                                                      '"float32"}')
    tok = tokenizer_pb2.GetTokenizerInfoResponse(model_name="m", fingerprint="ab", tokenizer_path="/tok/m")
    generation: Any = SimpleNamespace(target_kind="router", target_address="r:1")
    card = make_card(info, tok, None, generation, "t:2")
    assert (card.model_path, card.tokenizer_path, card.context_len, card.max_running_requests) == \
        ("/models/m", "/tok/m", 2048, 8)
    assert card.extra["dtype"] == "float32" and card.extra["tokenizer"] is None  # the workers' engine flags
    assert (card.extra["backend"], card.extra["router"], card.extra["tokenizer_address"]) == ("grpc", "r:1", "t:2")


def _serving_info(monkeypatch: pytest.MonkeyPatch, answer: Any) -> None:
    monkeypatch.setattr(server_info, "get_json", lambda url, timeout_s=0.0: answer)


def test_tokenizer_comes_from_model_info(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _serving_info(monkeypatch, {"tokenizer_path": str(tmp_path), "model_path": ""})
    assert server_info.tokenizer_dir(None, "http://h:1") == (str(tmp_path), "http://h:1/model_info tokenizer_path")
    _serving_info(monkeypatch, {"tokenizer_path": "org/name", "model_path": "/not/here"})
    assert server_info.tokenizer_dir(None, "http://h:1")[0] == "org/name"
    assert server_info.tokenizer_dir("/explicit", "http://h:1") == ("/explicit", "--tokenizer")


@pytest.mark.parametrize("answer", [None, {"tokenizer_path": "", "model_path": ""},
                                    {"tokenizer_path": "/not/on/this/machine", "model_path": "/nor/this"}])
def test_no_usable_tokenizer_says_what_to_pass(monkeypatch: pytest.MonkeyPatch, answer: Any) -> None:
    _serving_info(monkeypatch, answer)
    with pytest.raises(ValueError, match="pass --tokenizer <directory or Hugging Face name>"):
        server_info.tokenizer_dir(None, "http://h:1")


def test_unloadable_tokenizer_is_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot load the tokenizer .*; pass --tokenizer") as caught:
        server_info.load_tokenizer(str(tmp_path), "http://h:1/model_info tokenizer_path")
    assert "\n" not in str(caught.value)


def test_bench_serving_without_a_tokenizer_exits_with_the_hint(capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Path) -> None:
    with running_fake_server(FakeServer()) as url:  # its /model_info names a model path that does not exist
        code = bench_main(["serving", "--base-url", url, "--num-prompts", "1", "--disable-tqdm",
                           "--output-file", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert "bench serving: error:" in err and "pass --tokenizer" in err and "Traceback" not in err
