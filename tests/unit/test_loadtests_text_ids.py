"""`random-text-ids`: `random`'s text of a seed, sent as the ids the server makes of it, so twins' prompts are equal
token for token and `bench paired` compares the text path alone, over the same prompt lengths."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from loadtests.fakes import WordTokenizer
from loadtests.paired import cmd_paired
from loadtests.serving import add_serving_args
from loadtests.workloads import get_workload
from loadtests.workloads.base import Workload
from radixmesh.engine.tokenize_pool import Encoded, TokenizerPool

BOS_ID = 1


class BosWordTokenizer(WordTokenizer):
    """A word tokenizer that, like Llama's, starts an encoded text with BOS when asked for the special tokens."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [BOS_ID] * add_special_tokens + super().encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def default_tokenizer(default_model_dir: Path) -> Any:
    from radixmesh.engine.hf_tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


def build(name: str, tokenizer: Any, input_len: int, num_prompts: int, seed: int = 3) -> Workload:
    parser = argparse.ArgumentParser()
    add_serving_args(parser)
    args = parser.parse_args(["--workload", name, "--random-input-len", str(input_len), "--random-output-len", "4"])
    return get_workload(name).build(args, tokenizer, num_prompts, seed)


def server_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """What `serve`'s front end makes of text prompts: the gateway's `backend.encode` is `TokenizerPool.encode`."""
    async def run() -> list[list[int]]:
        pool = TokenizerPool(tokenizer, num_workers=2)
        try:
            encoded: list[Encoded[None]] = await asyncio.gather(*(pool.encode(t) for t in texts))
            return [e.ids for e in encoded]
        finally:
            pool.close()

    return asyncio.run(run())


@pytest.mark.parametrize("which", ["default", "bos-words"])
def test_text_ids_are_the_servers_tokens_of_the_random_text(which: str, request: pytest.FixtureRequest) -> None:
    tokenizer = request.getfixturevalue("default_tokenizer") if which == "default" else BosWordTokenizer()
    text = build("random", tokenizer, 600, 12)
    text_ids = build("random-text-ids", tokenizer, 600, 12)
    texts = [s.turns[0].prompt for s in text.sessions]
    assert all(isinstance(t, str) for t in texts)
    expected = server_ids(tokenizer, [str(t) for t in texts])
    assert [s.turns[0].prompt for s in text_ids.sessions] == expected
    assert [s.turns[0].prompt_len for s in text.sessions] == [s.turns[0].prompt_len for s in text_ids.sessions] \
        == [len(ids) for ids in expected]
    sampled = [s.turns[0].prompt for s in build("random-ids", tokenizer, 600, 12).sessions]
    if which == "default":  # re-tokenized text is not the sampled ids (it is longer)
        assert sum(map(len, expected)) > sum(map(len, sampled))
    else:
        assert all(ids[0] == BOS_ID and ids[1:] == s for ids, s in zip(expected, sampled))


def _result_file(path: Path, workload: Workload, ttft_ms: Any) -> Path:
    """A `bench serving` result of `workload` whose request i took `ttft_ms(i, prompt_len)` to its first token."""
    requests = [{"session_id": s.session_id, "turn_index": 0, "success": True, "prompt_len": s.turns[0].prompt_len,
                 "start_s": float(s.session_id), "ttft_s": ttft_ms(s.session_id, s.turns[0].prompt_len) / 1e3,
                 "itl_s": [0.007] * 3} for s in workload.sessions]
    header = {"name": workload.name, "params": workload.params, "num_sessions": len(workload.sessions),
              "num_requests": workload.num_requests}
    path.write_text(json.dumps({"workload": header, "load": {"seed": 3}, "runs": [{"label": "x",
                                                                                    "requests": requests}]}))
    return path


def convex_ttft_ms(i: int, prompt_len: int) -> float:
    """TTFT convex in length (4.8 ms per (1k tokens)^2, as on the GPU host), with a wobble each twin shares."""
    k = prompt_len / 1000
    return 20 + 15 * k + 4.8 * k * k + (-1) ** i * (i % 7)


def test_paired_text_against_text_ids_measures_the_text_path_alone(
        default_tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The text path here costs 0.3 ms per 1k tokens more; `random-text-ids` shows that, `random-ids` (its prompts
    are shorter, so its line is fitted where TTFT is less steep) shows more than that."""
    def text_ttft_ms(i: int, prompt_len: int) -> float:
        return convex_ttft_ms(i, prompt_len) + 0.3 * prompt_len / 1000

    text = _result_file(tmp_path / "text.json", build("random", default_tokenizer, 4096, 60), text_ttft_ms)
    slopes = {}
    for ids_name in ("random-text-ids", "random-ids"):
        ids = _result_file(tmp_path / "ids.json", build(ids_name, default_tokenizer, 4096, 60), convex_ttft_ms)
        out = tmp_path / f"{ids_name}-vs-text.json"
        assert cmd_paired(argparse.Namespace(a=ids, b=text, label_a=None, label_b=None, output_file=out)) == 0
        captured = capsys.readouterr()
        assert "warning" not in captured.err and "TTFT per 1k prompt tokens" in captured.out
        slopes[ids_name] = json.loads(out.read_text())["ttft_slope"]
    assert slopes["random-text-ids"]["diff_per_1k_ms"] == pytest.approx(0.3, abs=0.01)
    assert slopes["random-text-ids"]["diff_se_ms"] < 0.01  # twins of one length: the wobble cancels
    assert slopes["random-ids"]["diff_per_1k_ms"] > 0.3 + 0.5, slopes  # the convexity's artefact, ~1 ms per 1k
