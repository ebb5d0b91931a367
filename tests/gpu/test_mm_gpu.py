"""Multimodal models on a GPU: tiny random-weight LLaVA, Qwen2-VL and Qwen2.5-VL (saved by transformers) give
Hugging Face's greedy tokens with the triton backend, CUDA graphs and overlap (M-RoPE decode reads its
per-row delta inside the graphs), for a batch of prompts with different images and with a shared one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixmesh import Engine
from tests import mm_factory as mf

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
torch.backends.cudnn.allow_tf32 = False  # transformers' patch convolutions in exact float32, as the engine's GEMMs

MAX_NEW = 16
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
PNGS = [mf.image_png(1, 100, 70), mf.image_png(2, 60, 90), mf.image_png(3, 84, 84)]
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PLACEHOLDER = {"llava": "<image>\n", "qwen2_vl": QWEN_IMAGE, "qwen2_5_vl": QWEN_IMAGE}
HF = {"llava": mf.hf_llava_greedy, "qwen2_vl": mf.hf_qwen2_vl_greedy, "qwen2_5_vl": mf.hf_qwen2_vl_greedy}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("mm-gpu")
    tok = mf.tokenizer_dir(mf.default_tokenizer_source(), base / "tok")
    return {"llava": mf.llava_dir(tok, base / "llava"), "qwen2_vl": mf.qwen2_vl_dir(tok, base / "qwen2_vl"),
            "qwen2_5_vl": mf.qwen2_5_vl_dir(tok, base / "qwen2_5_vl")}


def _cases(arch: str) -> list[tuple[str, list[bytes]]]:
    image = PLACEHOLDER[arch]
    return [(f"USER: {image}What is it? ASSISTANT:", [PNGS[0]]),
            (f"USER: {image}{image}Compare them. ASSISTANT:", [PNGS[1], PNGS[2]]),
            (f"USER: {image}Describe it. ASSISTANT:", [PNGS[2]]),
            (f"USER: {image}What is it? ASSISTANT:", [PNGS[2]])]  # shares its image with the one before


GRAPHS = {"attention_backend": "triton", "overlap_schedule": "on"}
CHUNKED = {**GRAPHS, "chunked_prefill_size": 16}
EAGER = {"attention_backend": "torch-native", "disable_cuda_graph": True, "overlap_schedule": "off"}


@pytest.mark.parametrize(("arch", "engine_args"), [
    ("llava", GRAPHS), ("qwen2_vl", GRAPHS), ("qwen2_5_vl", GRAPHS), ("qwen2_vl", CHUNKED), ("llava", EAGER),
], ids=["llava-graphs", "qwen2_vl-graphs", "qwen2_5_vl-graphs", "qwen2_vl-chunked", "llava-eager"])
def test_image_prompts_match_transformers_on_cuda(models: dict[str, Path], arch: str,
                                                  engine_args: dict[str, object]) -> None:
    cases = _cases(arch)
    want = [HF[arch](models[arch], prompt, pngs, MAX_NEW, device="cuda") for prompt, pngs in cases]
    with Engine(str(models[arch]), device="cuda", dtype="float32", mem_fraction_static=0.3, cuda_graph_max_bs=8,
                **engine_args) as engine:
        batched = engine.generate([p for p, _ in cases], GREEDY,
                                  image_data=[[mf.data_url(png) for png in pngs] for _, pngs in cases])
        again = engine.generate(cases[0][0], GREEDY, image_data=mf.data_url(cases[0][1][0]))
    assert isinstance(batched, list) and isinstance(again, dict)
    assert [r["output_ids"] for r in batched] == want
    assert again["output_ids"] == want[0]
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1
