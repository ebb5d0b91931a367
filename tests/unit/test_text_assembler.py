"""The front end's text of a request (engine/output.py): streamed outputs detokenized, stop strings held back and
cut, the stop token left out, and whole completions in SGLang's result shape."""

from __future__ import annotations

from radixmesh.engine.output import GenerationResult, TextAssembler
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.outputs import GenerationChunk
from radixmesh.wire.sampling import SamplingParams

from .test_detokenizer import byte_level_tokenizer


def encode(text: str) -> list[int]:
    return list(byte_level_tokenizer().encode(text, add_special_tokens=False))


def out(ids: list[int], finish: str | None = None, matched: str | int | None = None, **kwargs: object) -> TokenOut:
    return TokenOut("r", ids, 4, 1, len(ids), finish_reason=finish, matched_stop=matched, **kwargs)  # type: ignore[arg-type]


def stream(assembler: TextAssembler, ids: list[int], finish: str | None = "length",
           matched: str | int | None = None) -> list[str]:
    """Feed `ids` one per output, the last with `finish`; the text of each chunk."""
    texts = [assembler.feed(out([i])).text for i in ids[:-1]]
    texts.append(assembler.feed(out(ids[-1:], finish, matched)).text)
    return texts


def test_streamed_text_concatenates_to_the_whole() -> None:
    text = "the quick brown fox jumps over the lazy dog"
    assembler = TextAssembler(byte_level_tokenizer(), SamplingParams())
    assert "".join(stream(assembler, encode(text))) == text


def test_a_stop_string_is_held_back_then_cut_with_everything_after() -> None:
    text = "the answer is 42. END of story"
    assembler = TextAssembler(byte_level_tokenizer(), SamplingParams(stop=("END",)))
    pieces = stream(assembler, encode(text), finish="stop", matched="END")
    assert "".join(pieces) == "the answer is 42. "
    assert not any("EN" in p for p in pieces)


def test_a_prefix_of_a_stop_string_that_does_not_complete_is_released_at_the_end() -> None:
    assembler = TextAssembler(byte_level_tokenizer(), SamplingParams(stop=("ENDING",)))
    assert "".join(stream(assembler, encode("stop here END"))) == "stop here END"


def test_the_stop_token_is_not_part_of_the_text() -> None:
    tokenizer = byte_level_tokenizer()
    stop_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assembler = TextAssembler(tokenizer, SamplingParams(stop_token_ids=(stop_id,), skip_special_tokens=False))
    ids = [*encode("hello world"), stop_id]
    assert "".join(stream(assembler, ids, finish="stop", matched=stop_id)) == "hello world"


def test_nothing_comes_after_a_stop() -> None:
    assembler = TextAssembler(byte_level_tokenizer(), SamplingParams(stop=("fox",)))
    first = assembler.feed(out(encode("the quick brown fox jumps")))
    assert first.text == "the quick brown " and assembler.stopped
    assert assembler.feed(out(encode(" over"), "stop", "fox")).text == ""


def test_a_chunk_carries_the_outputs_counts_and_logprobs() -> None:
    assembler = TextAssembler(byte_level_tokenizer(), SamplingParams())
    token = TokenOut("r", encode("hi"), 7, 3, 2, logprobs=[-0.5, -0.25], top_logprobs=[[(1, -0.5)], [(2, -0.25)]],
                     finish_reason="length", input_logprobs=[None, -1.0])
    chunk = assembler.feed(token)
    assert (chunk.rid, chunk.text, chunk.prompt_tokens, chunk.cached_tokens, chunk.completion_tokens) == (
        "r", "hi", 7, 3, 2)
    assert chunk.logprobs == [-0.5, -0.25] and chunk.finish_reason == "length" and chunk.input_logprobs == [None, -1.0]
    assert chunk.engine_ttft_s is None


def chunk(text: str, ids: list[int], finish: str | None = None, **kwargs: object) -> GenerationChunk:
    return GenerationChunk("r", text, ids, 3, 1, len(ids), finish_reason=finish, **kwargs)  # type: ignore[arg-type]


def test_a_result_adds_up_its_chunks_into_the_native_shape() -> None:
    result = GenerationResult("r", input_ids=[10, 11, 12])
    result.add(chunk("Hel", [1], logprobs=[-0.1], input_logprobs=[None, -2.0, -3.0]))
    result.add(chunk("lo", [2], "stop", logprobs=[-0.2], matched_stop="!"))
    native = result.to_dict()
    assert native["text"] == "Hello" and native["output_ids"] == [1, 2]
    meta = native["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": "!"} and meta["completion_tokens"] == 1
    assert meta["output_token_logprobs"] == [(-0.1, 1), (-0.2, 2)]
    assert meta["input_token_logprobs"] == [(None, 10), (-2.0, 11), (-3.0, 12)]
    assert "output_top_logprobs" not in meta and "input_top_logprobs" not in meta


def test_an_unfinished_result_has_no_finish_reason() -> None:
    result = GenerationResult("r")
    result.add(chunk("x", [5]))
    assert result.to_dict()["meta_info"]["finish_reason"] is None
