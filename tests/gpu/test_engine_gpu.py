"""End to end on a GPU: triton backend with CUDA graphs and overlap gives the greedy tokens of
torch_native and of Hugging Face transformers, on the same random weights."""

from __future__ import annotations

import pytest
import torch

from radixmesh import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

MAX_NEW = 32


def _random_hf_model(path, **overrides) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
               rope_theta=500000.0, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
    cfg.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:  # wide weights: well-separated logits, stable greedy paths
                param.normal_(0, 1.5 / param.shape[1] ** 0.5)
            elif "norm" in name:
                param.fill_(1.0)
    model.save_pretrained(path)


@pytest.fixture(scope="module", params=[{"num_key_value_heads": 2}, {"num_key_value_heads": 8}],
                ids=["gqa4", "mha"])
def model_dir(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("random-llama")
    _random_hf_model(path, **request.param)
    return path


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 17, 64, 300, 1000, 33, 129, 8]
    return [torch.randint(10, 4000, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def hf_outputs(model_dir, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    outs = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=MAX_NEW, do_sample=False,
                                 min_new_tokens=MAX_NEW, pad_token_id=0)
        outs.append(out[0, len(ids):].tolist())
    del model
    torch.cuda.empty_cache()
    return outs


GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


@pytest.mark.parametrize("engine_args", [
    {"attention_backend": "torch-native", "disable_cuda_graph": True, "overlap_schedule": "off"},
    {"attention_backend": "triton", "disable_cuda_graph": True, "overlap_schedule": "off"},
    {"attention_backend": "triton", "overlap_schedule": "on"},
    {"attention_backend": "triton", "overlap_schedule": "on", "chunked_prefill_size": 128},
], ids=["torch-native", "triton-eager", "triton-graph-overlap", "triton-graph-overlap-chunked"])
def test_greedy_tokens_match_transformers(model_dir, prompts, hf_outputs, engine_args):
    with Engine(str(model_dir), dtype="float32", mem_fraction_static=0.3, cuda_graph_max_bs=16,
                **engine_args) as engine:
        batched = engine.generate(prompts, GREEDY)
        single = [engine.generate(p, GREEDY) for p in prompts[:3]]
    for got, want in zip(batched, hf_outputs):
        assert got["output_ids"] == want
    for got, want in zip(single, hf_outputs):
        assert got["output_ids"] == want


def test_bf16_triton_close_to_torch_native(model_dir, prompts):
    """In bf16 paths may fork late; the first tokens must agree."""
    results = []
    for backend in ("torch-native", "triton"):
        with Engine(str(model_dir), dtype="bfloat16", attention_backend=backend, mem_fraction_static=0.3) as eng:
            results.append(eng.generate(prompts, {**GREEDY, "max_new_tokens": 4}))
    agree = sum(a["output_ids"][:2] == b["output_ids"][:2] for a, b in zip(*results))
    assert agree >= len(prompts) - 1
