"""The real default model: download (first run), GGUF conversion, cache hit, and Hugging Face output.

Greedy text from transformers over the converted directory is what proves the GGUF q/k
rope un-permutation right: with the permuted order left in, the answer is garbage.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from radixmesh.engine.loader import ensure_default_model, iter_weights, prepare_model
from radixmesh.engine.loader.default_model import COMPLETE_MARKER

pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    start = time.perf_counter()
    path = ensure_default_model()
    print(f"\nensure_default_model (first call in this process): {time.perf_counter() - start:.2f} s")
    return path


def test_second_call_is_cached(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from radixmesh.engine.loader import default_model

    # neither downloads nor converts again (counted, not timed: a loaded machine stalls)
    fetched: list[object] = []
    monkeypatch.setattr(default_model, "_find_default_gguf", lambda *args: fetched.append(args))
    start = time.perf_counter()
    assert ensure_default_model() == model_dir
    elapsed = time.perf_counter() - start
    print(f"\ncached ensure_default_model: {elapsed * 1000:.2f} ms")
    assert fetched == []
    assert (model_dir / COMPLETE_MARKER).is_file()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file(), name


def test_prepared_default_model_loads_into_native_model(model_dir: Path) -> None:
    from radixmesh.engine.models.registry import model_class

    prepared = prepare_model(None)
    assert (prepared.name, prepared.model_path, prepared.tokenizer_path) == (
        "smollm2-135m-instruct", model_dir, model_dir)
    config = prepared.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert config.tie_word_embeddings and config.vocab_size == 49152
    model = model_class(config.family)(config)
    model.load_weights(iter_weights(prepared))  # every HF name present, every shape right


def test_transformers_answers_paris(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(str(prompt), add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=tok.eos_token_id)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"\nSmolLM2-135M-Instruct (GGUF -> safetensors, transformers): {answer!r}")
    assert "Paris" in answer
