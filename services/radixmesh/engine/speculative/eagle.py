"""EAGLE and EAGLE-3 drafts: a one-layer head over the target's features (models/eagle.py), run like a draft model.

The head keeps its own KV (one layer) per request, position t holding what it computed from the target's
features of position t and the embedding of token t + 1. Per step, the catch-up EXTEND pass feeds every
position whose target features exist (up to the one before the request's last token: the target has not
run that token yet) and not yet in the head's KV, reading the features the target stored by KV slot
(`HiddenCapture`: the target's own passes, prefill, decode or verify, wrote them; nothing is copied out).
Its last row's logits give draft 1; each further draft step is one DECODE pass over the previous draft
token and the head's own output features (static buffers: they replay the head's CUDA graphs). After
verification only the catch-up KV stays (drafted positions were computed from the head's guesses, not the
target's features; the next catch-up recomputes the accepted ones from the real ones).
EAGLE-3's draft vocabulary maps to the target's through `d2t`. With `--speculative-eagle-topk` > 1 the head drafts
trees instead (eagle_tree.py), verified with a tree mask.
"""

from __future__ import annotations

import logging

import torch

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.device_io import to_device
from radixmesh.engine.models.eagle import EagleDraft
from radixmesh.engine.request import Req
from radixmesh.engine.speculative.base import Proposal, ProposerContext
from radixmesh.engine.speculative.draft_model import DraftModelProposer, _Shadow
from radixmesh.engine.speculative.eagle_tree import TreeDrafter
from radixmesh.engine.speculative.tree_loop import make_tree_loop

logger = logging.getLogger(__name__)

MAX_TREE_BATCH = 64
"""Most requests drafting trees of several levels in one step (their beams' rows); more draft one level."""
TARGET_WEIGHTS = {"embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}
"""Head weights a checkpoint may leave out -> the target's parameter they come from."""


class EagleProposer(DraftModelProposer):
    """Drafts from an EAGLE or EAGLE-3 head (`--speculative-algorithm eagle|eagle3`): chains (top-1) or trees."""

    id = "eagle"
    shares_prefixes = False

    def __init__(self, ctx: ProposerContext) -> None:
        config = ctx.config
        self.topk = config.speculative_eagle_topk
        if self.topk > 1 and not ctx.target.attn_backend.supports_tree_mask:
            raise invalid_argument(f"--speculative-eagle-topk > 1 verifies draft trees with a tree mask, which the "
                                   f"{type(ctx.target.attn_backend).__name__} attention backend does not take: use "
                                   "--attention-backend triton or torch_native", "speculative_eagle_topk")
        self.tree: TreeDrafter | None = None
        self._catch_up_slots: torch.Tensor | None = None
        """The target KV slots of the catch-up's tokens, in packed order (their features' rows)."""
        self._graph_rows: list[int] | None = None
        """Each of them's row in a replayed catch-up graph's layout (None: the catch-up ran eagerly)."""
        super().__init__(ctx)
        head = self.head
        self._prev: torch.Tensor | None = None
        """The previous pass's output features of the drafting chains, in chain order."""
        self._draft_ids = torch.arange(head.draft_vocab, device=self.device)
        if self.topk > 1:
            self.tree = TreeDrafter(self, self.topk, config.speculative_tree_steps, config.speculative_max_drafts)
            self.tree.loop = make_tree_loop(self.runner, head, self.topk, config.speculative_tree_steps - 1,
                                            config.cuda_graph_max_bs, self._to_target)
        logger.info("EAGLE%s head: %d-token draft vocabulary, features %d wide, %s", "-3" if head.eagle3 else "",
                    head.draft_vocab, head.feature_dim,
                    f"trees (top-{self.topk}, {config.speculative_tree_steps} steps, up to "
                    f"{config.speculative_max_drafts} nodes)" if self.tree else "chains")

    def propose(self, reqs: list[Req], max_drafts: list[int]) -> Proposal:
        if self.tree is not None:
            return self.tree.propose(reqs, max_drafts)
        return super().propose(reqs, max_drafts)

    def _draft_rows(self, config: EngineConfig, num_requests: int) -> int:
        topk = config.speculative_eagle_topk  # trees: a row per beam of up to MAX_TREE_BATCH requests drafting at once
        return num_requests + (topk * min(num_requests, MAX_TREE_BATCH) if topk > 1 else 0)

    def _loop_steps(self, config: EngineConfig) -> int:
        return 0 if config.speculative_eagle_topk > 1 else super()._loop_steps(config)  # (trees step pass by pass)

    def _setup_runner(self, ctx: ProposerContext) -> None:
        """The target's feature pool and, where the checkpoint has none, its embedding and LM head."""
        head = self.head
        target = ctx.target.model
        capture = getattr(getattr(target, "model", None), "capture", None)
        assert capture is not None, "the target stores no features for the head (eagle_setup.build_capture)"
        self.features = head.feature_pool = capture.pool
        self.target_rows = ctx.target.req_pool.req_to_token
        target_params = dict(target.named_parameters())
        head_params = dict(head.named_parameters())
        for name in head.missing_optional:  # copied in: the head's CUDA graphs read its own tensors
            source = target_params[TARGET_WEIGHTS[name]]
            if tuple(source.shape) != tuple(head_params[name].shape):
                raise ValueError(f"the head's {name} has shape {tuple(head_params[name].shape)}, the target's "
                                 f"{tuple(source.shape)}")
            with torch.no_grad():
                head_params[name].copy_(source)

    def _catch_up_graph_tokens(self, config: EngineConfig) -> int:
        depth = config.speculative_tree_steps if config.speculative_eagle_topk > 1 else config.speculative_max_drafts
        return depth + 1  # the accepted drafts and the token after them

    @property
    def head(self) -> EagleDraft:
        head = self.runner.model
        assert isinstance(head, EagleDraft), f"an EAGLE head was expected, got {type(head).__name__}"
        return head

    # ---- the head's passes ------------------------------------------------------------------
    def _catch_up_len(self, req: Req) -> int:
        return req.fill_len - 1  # the last token has no target features yet

    def _fed_tokens(self, sreq: Req, start: int, feed: int) -> list[int]:
        return sreq.all_ids[start + 1:start + 1 + feed]  # position t reads token t + 1

    def _before_catch_up(self, reqs: list[Req], fed: list[tuple[int, int, int]]) -> None:
        slots = []
        for index, start, feed in fed:
            row = reqs[index].req_pool_idx
            assert row is not None, f"request {reqs[index].rid} drafts without a target row"
            slots.append(self.target_rows[row, start:start + feed])
        self._catch_up_slots = torch.cat(slots)
        self._graph_rows = None

    def _before_eager_catch_up(self) -> None:
        assert self._catch_up_slots is not None
        self.head.features = self.features.index_select(0, self._catch_up_slots)

    def _stage_catch_up(self, graph_rows: list[int]) -> None:
        assert self._catch_up_slots is not None
        slots = self.head.feature_slots
        slots.zero_()  # padding tokens read the dummy slot's features
        slots.index_copy_(0, to_device(graph_rows, torch.int64, self.device), self._catch_up_slots)
        self._graph_rows = graph_rows

    def _after_catch_up(self, rows: torch.Tensor, feeds: list[int]) -> None:
        head = self.head
        head.features = None
        lasts, offset = [], 0
        for feed in feeds:
            offset += feed
            lasts.append(offset - 1)
        if self._graph_rows is not None:  # the outputs sit in the replayed graph's layout
            hidden = head.graph_hidden
            lasts = [self._graph_rows[r] for r in lasts]
        else:
            assert head.extend_hidden is not None
            hidden = head.extend_hidden
        self._prev = hidden.index_select(0, to_device(lasts, torch.int64, self.device).index_select(0, rows))

    def _before_decode(self, keep: list[int]) -> None:
        assert self._prev is not None, "a draft decode pass before the catch-up"
        n = len(keep)
        self.head.draft_in[:n].copy_(self._prev.index_select(0, to_device(keep, torch.int64, self.device)))
        self._prev = self.head.hidden_out[:n]

    def _before_loop(self, bs: int) -> None:
        assert self._prev is not None, "the draft loop before the catch-up"
        self.head.draft_in[:bs].copy_(self._prev)

    def _between_steps(self, bs: int) -> None:
        self.head.draft_in[:bs].copy_(self.head.hidden_out[:bs])

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.draft_to_target(ids)

    def _target_probs(self, q: torch.Tensor) -> torch.Tensor:
        if q.shape[1] == self.runner.model_config.vocab_size and not self.head.eagle3:
            return q
        full = torch.zeros(q.shape[0], self.runner.model_config.vocab_size, dtype=q.dtype, device=q.device)
        full[:, self.head.draft_to_target(self._draft_ids)] = q
        return full

    def _kept(self, req: Req, shadow: _Shadow, end: int, num_accepted: int) -> int:
        return min(shadow.req.kv_len, len(req.all_ids) - 1)  # only the catch-up's KV came from real features
