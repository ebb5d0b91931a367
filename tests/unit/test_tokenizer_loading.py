"""The tokenizer loader: a directory naming the generic fast tokenizer skips AutoTokenizer's class lookup
(and with it the torch import) and gives AutoTokenizer's tokenizer; any other class goes through it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from radixmesh.engine.hf_tokenizer import load_tokenizer, names_generic_fast_tokenizer

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n", "<|im_start|>user\nhi<|im_end|>", "ünïcødé 漢字 🙂",
         "def f(x):\n    return x * 2\n", ""]


def test_the_fast_path_gives_autotokenizers_tokenizer(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    assert names_generic_fast_tokenizer(default_model_dir)
    fast, auto = load_tokenizer(default_model_dir), AutoTokenizer.from_pretrained(str(default_model_dir))
    assert type(fast) is type(auto)
    for text in TEXTS:
        ids = auto.encode(text)
        assert fast.encode(text) == ids, text
        assert fast.decode(ids) == auto.decode(ids)
    assert fast.all_special_ids == auto.all_special_ids and fast.eos_token_id == auto.eos_token_id
    assert len(fast) == len(auto) and fast.get_vocab() == auto.get_vocab()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_other_classes_and_hub_ids_go_through_autotokenizer(default_model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(default_model_dir, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    config_path = copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    config_path.write_text(json.dumps(config))
    assert not names_generic_fast_tokenizer(copy)
    assert load_tokenizer(copy).encode("Hello") == load_tokenizer(default_model_dir).encode("Hello")
    assert not names_generic_fast_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")
    (copy / "tokenizer_config.json").write_text("{not json")
    assert not names_generic_fast_tokenizer(copy)


def test_a_bad_directory_is_a_clear_error(tmp_path: Path) -> None:
    from radixmesh.common.errors import RadixMeshError

    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(RadixMeshError, match="cannot load the tokenizer from"):
        load_tokenizer(tmp_path)
