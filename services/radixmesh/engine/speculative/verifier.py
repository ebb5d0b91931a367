"""One verify pass: the target's logits at every draft position, then acceptance, on the device.

Each row is sampled exactly as the plain `Sampler` would sample that position (bias, penalties,
min_new_tokens, grammar mask, then greedy argmax or the truncated temperature distribution), so
greedy output equals non-speculative output and log-probs are the same numbers. Only the choice
of the emitted tokens differs for sampled rows: rejection sampling, which keeps the distribution.
Draft trees (tree.py) are accepted greedily along the tree; their passes carry a tree mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixmesh.engine.attention.base import ForwardBatch, ForwardMode
from radixmesh.engine.device_io import HostCopy, rows_to_device, tensor_to_device, to_device
from radixmesh.engine.grammar.vocab_mask import VocabMask
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.sampling.batch_info import SamplingBatchInfo
from radixmesh.engine.sampling.prompt_logprobs import top_pairs
from radixmesh.engine.sampling.sampler import (
    SEED_MASK,
    HostSample,
    SampleOutput,
    argmax,
    process_logits,
    seeded_step_key,
)
from radixmesh.engine.speculative.rejection import (
    ChainRows,
    accepted_lengths,
    chain_tokens,
    greedy_accept,
    inverse_cdf,
    residual_sample,
    sampled_accept,
    target_probs,
)
from radixmesh.engine.speculative.tree import build_tree_mask, depths, tree_accept, tree_rows
from radixmesh.engine.speculative.verify_batch import VerifyBatch
from radixmesh.engine.speculative.verify_graphs import VerifyGraphRunner

ACCEPT_SALT = 0x5A17
RESAMPLE_SALT = 0x7E57


@dataclass
class VerifyHostSample(HostSample):
    """Host results of a verify pass: `token_ids` (and log-probs) per packed row."""

    num_accepted: list[int] | None = None
    """Accepted drafts per request."""
    row_starts: list[int] | None = None
    emit_rows: list[int] | None = None
    """Draft trees: packed row `row_starts[i] + d` holds the token emitted after the accepted path's row
    `emit_rows[row_starts[i] + d]` (d <= accepted; the path's rows, root first). None: chains."""

    def token_rows(self, row: int) -> range:
        assert self.num_accepted is not None and self.row_starts is not None
        start = self.row_starts[row]
        return range(start, start + self.num_accepted[row] + 1)


@dataclass
class VerifyOutput(SampleOutput):
    """Device results of a verify pass; `next_token_ids` is per packed row."""

    num_accepted: torch.Tensor | None = None
    """[batch] int64."""
    row_starts: list[int] | None = None
    emit_rows: torch.Tensor | None = None
    """[rows] int64, draft trees only (see `VerifyHostSample.emit_rows`)."""

    def start_copy(self) -> None:
        self.host_copy = HostCopy([self.next_token_ids, self.logprobs, self.top_logprob_ids,
                                   self.top_logprob_values, self.num_accepted, self.emit_rows])

    def to_host(self) -> VerifyHostSample:
        if self.host_copy is None:
            self.start_copy()
        assert self.host_copy is not None
        ids, logprobs, top_ids, top_values, accepted, emit = self.host_copy.wait()
        assert ids is not None and accepted is not None
        return VerifyHostSample(token_ids=ids.tolist(), logprobs=logprobs.tolist() if logprobs is not None else None,
                                top_logprobs=top_pairs(top_ids, top_values), num_accepted=accepted.tolist(),
                                row_starts=self.row_starts, emit_rows=emit.tolist() if emit is not None else None)


class Verifier:
    """Runs verify passes on the target runner (replaying `graphs` where one holds the batch);
    `seed` drives rows of requests without their own."""

    def __init__(self, runner: ModelRunner, seed: int, graphs: VerifyGraphRunner | None = None,
                 tree_graphs: VerifyGraphRunner | None = None) -> None:
        self.runner = runner
        self.graphs = graphs
        self.tree_graphs = tree_graphs
        """Graphs of draft-tree passes (with a tree mask), beside the chains' `graphs`."""
        self._shared = torch.Generator(device="cpu")
        self._shared.manual_seed((seed ^ ACCEPT_SALT) & SEED_MASK)
        self._seeded = torch.Generator(device="cpu")

    def forward(self, batch: VerifyBatch) -> torch.Tensor:
        """Float32 logits `[rows, vocab]` at every fed token, in packed order."""
        graphs = self.graphs if batch.trees is None else self.tree_graphs
        key = graphs.key(batch) if graphs is not None else None
        if graphs is not None and key is not None:
            return graphs.replay(batch, key)
        return self._forward_eager(batch)

    def _forward_eager(self, batch: VerifyBatch) -> torch.Tensor:
        r = self.runner
        device = r.device
        starts = batch.row_starts
        lasts = [s + n - 1 for s, n in zip(starts, batch.extend_lens)]
        last_set = set(lasts)
        extra = [i for i in range(batch.num_rows) if i not in last_set]
        # the model returns the last rows first, then `extra`: `order[i]` is packed row i's place there
        place = {row: i for i, row in enumerate(lasts + extra)}
        order = [place[i] for i in range(batch.num_rows)]
        input_ids, positions, pool_rows, seq_lens, prefix_lens, extend_lens, extra_t, order_t = rows_to_device(
            [batch.input_ids, batch.positions, batch.req_pool_indices, batch.seq_lens, batch.prefix_lens,
             batch.extend_lens, extra, order], device)
        fb = ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=input_ids, positions=positions, out_cache_loc=batch.out_cache_loc,
            req_pool_indices=pool_rows, seq_lens=seq_lens, extend_prefix_lens=prefix_lens, extend_seq_lens=extend_lens,
            req_to_token_pool=r.req_pool, token_to_kv_pool=r.kv_pool, attn_backend=r.attn_backend,
            seq_lens_cpu=batch.seq_lens, extend_prefix_lens_cpu=batch.prefix_lens,
            extend_seq_lens_cpu=batch.extend_lens, extra_logit_rows=extra_t if extra else None,
            req_pool_indices_cpu=batch.req_pool_indices,
            tree_mask=build_tree_mask(batch.trees, device) if batch.trees is not None else None)
        batch.put_device_drafts(input_ids)
        r.attn_backend.init_forward_metadata(fb)
        logits: torch.Tensor = r.model(fb.input_ids, fb.positions, fb)
        return logits.index_select(0, order_t)

    def sampling_info(self, batch: VerifyBatch) -> SamplingBatchInfo:
        """The `Sampler`'s per-row info for every packed row: row i of a request sees its output plus
        its first i drafts (penalties, min_new_tokens and seeds follow)."""
        params, prompts, outputs, output_lens = [], [], [], []
        for r, (req, drafts) in enumerate(zip(batch.reqs, batch.drafts)):
            penalised = req.params.has_penalties
            # a tree's row sits at its node's depth (tree requests have no penalties: the output alone)
            levels = depths(batch.trees[r]) if batch.trees is not None else range(len(drafts) + 1)
            assert batch.trees is None or not penalised or not drafts, f"request {req.rid}: a draft tree with penalties"
            for i in levels:
                params.append(req.params)
                prompts.append(req.origin_input_ids)
                outputs.append(req.output_ids + drafts[:i] if penalised else req.output_ids)
                output_lens.append(len(req.output_ids) + i)
        mc = self.runner.model_config
        return SamplingBatchInfo.build(params, prompts, outputs, mc.eos_token_ids, mc.vocab_size, self.runner.device,
                                       output_lens=output_lens)

    def verify(self, batch: VerifyBatch, logits: torch.Tensor, info: SamplingBatchInfo,
               vocab_mask: VocabMask | None) -> VerifyOutput:
        """Accept each request's longest draft prefix and pick the token after it (device work only)."""
        device = logits.device
        info.vocab_mask = vocab_mask
        processed = process_logits(logits, info)
        if batch.trees is not None:
            return self._verify_tree(batch, processed, info)
        rows = self._chain_rows(batch, device)
        greedy_ids = argmax(processed)
        if batch.proposal is not None and batch.proposal.snap_ids is not None:
            greedy_ids = self._snap(batch, processed, greedy_ids)
        if info.all_greedy:
            num_accepted = accepted_lengths(greedy_accept(greedy_ids, rows), rows)
            final = greedy_ids
        else:
            assert info.is_greedy is not None
            p = target_probs(processed, info)
            q = self._draft_rows(batch, device)
            u_accept = tensor_to_device(self._uniforms(info, ACCEPT_SALT), device)
            u_resample = tensor_to_device(self._uniforms(info, RESAMPLE_SALT), device)
            accept = torch.where(info.is_greedy, greedy_accept(greedy_ids, rows),
                                 sampled_accept(p, q, rows, u_accept))
            num_accepted = accepted_lengths(accept, rows)
            final = torch.where(info.is_greedy, greedy_ids, residual_sample(p, q, rows, u_resample))
        tokens = chain_tokens(rows, num_accepted, final)
        out = VerifyOutput(next_token_ids=tokens, num_accepted=num_accepted, row_starts=batch.row_starts)
        return _finish(out, processed, info)

    def _verify_tree(self, batch: VerifyBatch, processed: torch.Tensor, info: SamplingBatchInfo) -> VerifyOutput:
        """Greedy acceptance along draft trees (tree.py); requests that sample have no drafts (their root row
        draws from the target's distribution, as a chain without drafts does)."""
        assert batch.trees is not None
        device = processed.device
        for req, drafts in zip(batch.reqs, batch.drafts):
            assert req.params.is_greedy or not drafts, f"request {req.rid}: a draft tree for a sampled request"
        final = argmax(processed)
        if not info.all_greedy:
            assert info.is_greedy is not None
            u_resample = tensor_to_device(self._uniforms(info, RESAMPLE_SALT), device)
            final = torch.where(info.is_greedy, final, inverse_cdf(target_probs(processed, info), u_resample))
        fed = to_device(batch.input_ids, torch.int64, device)
        batch.put_device_drafts(fed)
        num_accepted, emit = tree_accept(fed, final, tree_rows(batch.trees, device))
        out = VerifyOutput(next_token_ids=final.index_select(0, emit), num_accepted=num_accepted,
                           row_starts=batch.row_starts, emit_rows=emit)
        return _finish(out, processed.index_select(0, emit), info)

    @staticmethod
    def _chain_rows(batch: VerifyBatch, device: torch.device) -> ChainRows:
        draft_next: list[int] = []
        segment: list[int] = []
        position: list[int] = []
        for i, drafts in enumerate(batch.drafts):
            draft_next += [*drafts, -1]
            segment += [i] * (len(drafts) + 1)
            position += range(len(drafts) + 1)
        nxt, seg, pos = rows_to_device([draft_next, segment, position], device)
        # row r checks the draft fed at row r + 1
        batch.put_device_drafts(nxt, [r - 1 for r in batch.draft_rows])
        return ChainRows(nxt, seg, pos, len(batch.reqs))

    @staticmethod
    def _snap(batch: VerifyBatch, processed: torch.Tensor, greedy_ids: torch.Tensor) -> torch.Tensor:
        """The oracle's expected token where it is within the proposal's margin of the row's maximum logit."""
        proposal = batch.proposal
        assert proposal is not None and proposal.snap_ids is not None
        expected: list[int] = []
        for drafts, ids in zip(batch.drafts, proposal.snap_ids):
            rows = len(drafts) + 1
            expected += ids[:rows] + [-1] * (rows - len(ids[:rows]))
        exp = to_device(expected, torch.int64, processed.device)
        valid = exp >= 0
        picked = processed.gather(1, exp.clamp(min=0).unsqueeze(1)).squeeze(1)
        near = valid & (picked >= processed.max(dim=-1).values - proposal.snap_margin)
        if proposal.snap_count is not None:
            proposal.snap_count += (near & (greedy_ids != exp)).sum()
        return torch.where(near, exp, greedy_ids)

    @staticmethod
    def _draft_rows(batch: VerifyBatch, device: torch.device) -> torch.Tensor | None:
        """[rows, vocab] draft distribution of each row's draft (None: point masses); last rows get row 0."""
        proposal = batch.proposal
        if proposal is None or proposal.draft_probs is None:
            return None
        index: list[int] = []
        for first, drafts in zip(proposal.prob_rows, batch.drafts):
            index += [first + j for j in range(len(drafts))] + [0]
        return proposal.draft_probs.index_select(0, to_device(index, torch.int64, device))

    def _uniforms(self, info: SamplingBatchInfo, salt: int) -> torch.Tensor:
        """[rows] float32 in [0, 1): seeded rows depend only on (seed, position in the output, salt)."""
        uniforms = torch.rand(info.batch_size, generator=self._shared, dtype=torch.float32)
        for row, (seed, step) in enumerate(zip(info.seeds, info.output_lens)):
            if seed is not None:
                self._seeded.manual_seed(seeded_step_key(seed, step) ^ salt)
                uniforms[row] = torch.rand(1, generator=self._seeded, dtype=torch.float32)[0]
        return uniforms


def _finish(out: VerifyOutput, processed: torch.Tensor, info: SamplingBatchInfo) -> VerifyOutput:
    """Log-probs of each emitted token from `processed` (its rows in the emitted tokens' order); start the copy."""
    tokens = out.next_token_ids
    if info.return_logprobs or info.top_logprobs_num > 0:
        logprobs_all = torch.log_softmax(processed, dim=-1)
        if info.return_logprobs:
            out.logprobs = logprobs_all.gather(1, tokens.unsqueeze(1)).squeeze(1)
        if info.top_logprobs_num > 0:
            out.top_logprob_values, out.top_logprob_ids = torch.topk(
                logprobs_all, min(info.top_logprobs_num, logprobs_all.shape[-1]), dim=-1, sorted=True)
    out.start_copy()
    return out
