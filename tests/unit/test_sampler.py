"""Sampler and SamplingBatchInfo: processing order, truncation, seeded draws, log-probs (CPU)."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.sampling.batch_info import SamplingBatchInfo
from radixmesh.engine.sampling.sampler import Sampler, process_logits
from radixmesh.wire.sampling import SamplingParams

VOCAB = 32
EOS = 31


def make_info(params: list[SamplingParams], prompts: list[list[int]] | None = None,
              outputs: list[list[int]] | None = None, eos: tuple[int, ...] = (EOS,),
              vocab: int = VOCAB) -> SamplingBatchInfo:
    prompts = prompts if prompts is not None else [[1, 2, 3] for _ in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingBatchInfo.build(params, prompts, outputs, list(eos), vocab, "cpu")


def make_logits(bs: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(bs, vocab, generator=gen) * 3


def sample(logits: torch.Tensor, params: list[SamplingParams], sampler: Sampler | None = None,
           **info_kwargs: object) -> torch.Tensor:
    sampler = sampler or Sampler(seed=0)
    out = sampler(logits, make_info(params, **info_kwargs))  # type: ignore[arg-type]
    return out.next_token_ids


def test_greedy_is_argmax_for_any_dtype() -> None:
    logits = make_logits(6)
    params = [SamplingParams(temperature=0.0)] * 6
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ids = sample(logits.to(dtype), params)
        assert ids.dtype == torch.int64
        assert torch.equal(ids, torch.argmax(logits.to(dtype).float(), dim=-1))


def test_greedy_ties_pick_lowest_id() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, [7, 3, 20]] = 5.0
    assert sample(logits, [SamplingParams(temperature=0.0)]).tolist() == [3]


def test_plain_batch_builds_no_vocab_sized_tensors() -> None:
    info = make_info([SamplingParams(), SamplingParams(temperature=0.0)], outputs=[[4, 4], [5]])
    assert info.logit_bias is None and info.output_counts is None
    assert info.seen_mask is None and info.min_tokens_mask is None
    assert not info.all_greedy and not info.need_top_k and not info.need_top_p and not info.need_min_p
    assert info.is_greedy.tolist() == [False, True]
    assert info.temperatures.shape == (2, 1) and info.temperatures[1, 0] == 1.0


def test_input_logits_are_not_modified() -> None:
    logits = make_logits(2)
    before = logits.clone()
    params = [SamplingParams(logit_bias={1: 50.0}, frequency_penalty=1.0, min_new_tokens=3)] * 2
    Sampler(seed=0)(logits, make_info(params, outputs=[[1], [2]]), return_logprobs=True)
    assert torch.equal(logits, before)


def _seeded_run(row: int, others: list[SamplingParams], target: SamplingParams,
                logits_row: torch.Tensor, num_steps: int) -> list[int]:
    """Tokens drawn for `target` placed at `row` among `others` (fresh sampler each time)."""
    sampler = Sampler(seed=row + 100)  # different shared stream per composition
    params = list(others)
    params.insert(row, target)
    tokens: list[int] = []
    for step in range(num_steps):
        logits = make_logits(len(params), seed=1000 + step)
        logits[row] = logits_row
        outputs = [[0] * step for _ in params]
        ids = sampler(logits, make_info(params, outputs=outputs)).next_token_ids
        tokens.append(int(ids[row]))
    return tokens


def test_seeded_rows_reproduce_across_batch_compositions() -> None:
    target = SamplingParams(temperature=1.5, seed=1234)
    logits_row = torch.zeros(VOCAB)  # flat: every draw depends on the seed only
    alone = _seeded_run(0, [], target, logits_row, 24)
    mixed = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0),
             SamplingParams(temperature=1.0, seed=99, top_k=5), SamplingParams(top_p=0.5)]
    assert _seeded_run(2, mixed, target, logits_row, 24) == alone
    assert _seeded_run(4, mixed, target, logits_row, 24) == alone
    assert len(set(alone)) > 5, "a flat distribution should not repeat one token"
    other_seed = SamplingParams(temperature=1.5, seed=1235)
    assert _seeded_run(0, [], other_seed, logits_row, 24) != alone


def test_sampling_frequencies_follow_probabilities() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2])
    n = 4000
    logits = probs.log().expand(n, 3).clone()
    params = [SamplingParams(seed=i) for i in range(n)]
    ids = sample(logits, params, vocab=3, eos=())
    freq = torch.bincount(ids, minlength=3).float() / n
    assert torch.allclose(freq, probs, atol=0.05), freq


def test_top_k_one_is_greedy_and_top_k_limits_support() -> None:
    logits = make_logits(64, seed=3)
    argmax = torch.argmax(logits, dim=-1)
    assert torch.equal(sample(logits, [SamplingParams(top_k=1, temperature=2.0)] * 64), argmax)
    ids = sample(logits, [SamplingParams(top_k=3, temperature=5.0)] * 64)
    top3 = torch.topk(logits, 3, dim=-1).indices
    assert (top3 == ids.unsqueeze(1)).any(dim=1).all()
    assert not torch.equal(ids, argmax), "top_k=3 at high temperature should not always pick the max"


def test_tiny_top_p_is_greedy() -> None:
    logits = make_logits(64, seed=4)
    ids = sample(logits, [SamplingParams(top_p=1e-6, temperature=3.0)] * 64)
    assert torch.equal(ids, torch.argmax(logits, dim=-1))


def test_top_p_keeps_smallest_prefix_reaching_the_mass() -> None:
    probs = torch.tensor([0.45, 0.3, 0.15, 0.1])
    logits = probs.log().expand(400, 4).clone()
    ids = sample(logits, [SamplingParams(top_p=0.7, seed=i) for i in range(400)], vocab=4, eos=())
    assert set(ids.tolist()) == {0, 1}


def test_min_p_drops_unlikely_tokens() -> None:
    probs = torch.tensor([0.4, 0.25, 0.19, 0.16])  # min_p 0.5 -> threshold 0.2
    logits = probs.log().expand(400, 4).clone()
    ids = sample(logits, [SamplingParams(min_p=0.5, seed=i) for i in range(400)], vocab=4, eos=())
    assert set(ids.tolist()) == {0, 1}


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = make_logits(32, seed=5)
    forced = sample(logits, [SamplingParams(temperature=1.0, logit_bias={17: 100.0})] * 32)
    assert forced.tolist() == [17] * 32
    argmax = torch.argmax(logits, dim=-1)
    banned = [SamplingParams(temperature=0.0, logit_bias={int(t): -100.0}) for t in argmax]
    ids = sample(logits, banned)
    second = torch.topk(logits, 2, dim=-1).indices[:, 1]
    assert torch.equal(ids, second)


def test_frequency_and_presence_penalties_count_output_only() -> None:
    logits = make_logits(1, seed=6)
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.7)]
    info = make_info(params, prompts=[[9, 9, 9]], outputs=[[3, 3, 5]])
    expected = logits.clone()
    expected[0, 3] -= 2 * 0.5 + 0.7
    expected[0, 5] -= 0.5 + 0.7
    assert torch.allclose(process_logits(logits, info), expected)
    top = Sampler(seed=0)(logits, info, return_logprobs=True, top_logprobs_num=VOCAB).to_host().top_logprobs
    assert top is not None
    penalised = dict(top[0])
    plain = torch.log_softmax(logits[0], dim=-1)
    assert penalised[3] < plain[3].item() - 1.0
    assert penalised[5] < plain[5].item() - 0.5
    assert penalised[9] > plain[9].item()  # prompt-only token is not penalised (gains mass)


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, :6] = torch.tensor([4.0, -4.0, 2.0, -2.0, 3.0, -3.0])
    info = make_info([SamplingParams(repetition_penalty=2.0)], prompts=[[0, 1]], outputs=[[2, 3]])
    processed = process_logits(logits, info)[0, :6]
    assert processed.tolist() == [2.0, -8.0, 1.0, -4.0, 3.0, -3.0]


def test_penalties_only_touch_their_rows() -> None:
    logits = make_logits(2, seed=7)
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0), SamplingParams()]
    processed = process_logits(logits, make_info(params, outputs=[[4, 5], [4, 5]]))
    assert torch.equal(processed[1], logits[1])
    assert not torch.equal(processed[0], logits[0])


def test_min_new_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 12] = 9.0
    logits[:, 4] = 8.0
    params = [SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=(12,), ignore_eos=True)] * 2
    ids = sample(logits, params, outputs=[[1, 1], [1, 1, 1]])
    assert ids.tolist() == [4, EOS]
    info = make_info(params, outputs=[[1], [1, 2, 3]])
    top = Sampler()(logits, info, return_logprobs=True, top_logprobs_num=3).to_host().top_logprobs
    assert top is not None
    assert top[0][0][0] == 4
    assert process_logits(logits, info)[0, EOS] == float("-inf")


def test_logprobs_are_taken_before_temperature_and_truncation() -> None:
    logits = make_logits(5, seed=8)
    params = [SamplingParams(temperature=0.3, top_k=4, logit_bias={2: 3.0}, seed=i) for i in range(4)]
    params.append(SamplingParams(temperature=0.0))
    info = make_info(params)
    out = Sampler(seed=1)(logits, info, return_logprobs=True, top_logprobs_num=5)
    expected_all = torch.log_softmax(process_logits(logits, info), dim=-1)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    chosen = expected_all.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
    assert torch.allclose(out.logprobs, chosen)
    host = out.to_host()
    assert host.top_logprobs is not None and len(host.top_logprobs) == 5
    assert host.token_ids == out.next_token_ids.tolist() and host.logprobs == out.logprobs.tolist()
    for row, pairs in enumerate(host.top_logprobs):
        assert len(pairs) == 5
        values = [v for _, v in pairs]
        assert values == sorted(values, reverse=True)
        for token_id, value in pairs:
            assert value == pytest.approx(expected_all[row, token_id].item(), abs=1e-6)
        assert pairs[0][0] == int(torch.argmax(expected_all[row]))
    assert host.top_logprobs[4][0][1] == pytest.approx(out.logprobs[4].item())


def test_no_logprobs_unless_asked() -> None:
    out = Sampler()(make_logits(2), make_info([SamplingParams()] * 2))
    assert out.logprobs is None and out.top_logprob_ids is None and out.top_logprob_values is None
    host = out.to_host()
    assert host.logprobs is None and host.top_logprobs is None and host.token_ids == out.next_token_ids.tolist()


def test_mixed_batch_keeps_greedy_rows_exact() -> None:
    logits = make_logits(8, seed=9)
    params = [SamplingParams(temperature=0.0 if i % 2 else 2.0, seed=i) for i in range(8)]
    ids = sample(logits, params)
    argmax = torch.argmax(logits, dim=-1)
    assert torch.equal(ids[1::2], argmax[1::2])


def test_shape_mismatch_is_reported() -> None:
    with pytest.raises(AssertionError, match="do not match"):
        Sampler()(make_logits(2), make_info([SamplingParams()]))
