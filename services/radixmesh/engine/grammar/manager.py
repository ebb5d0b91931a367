"""The scheduler's grammar side: requests waiting for their grammar, matchers, masks, jump-forward.

Lifecycle of a grammar request: `submit` starts (or joins) its compilation and holds the
request; `collect` hands it to the waiting queue with a fresh matcher once the grammar is
ready (advanced over the output a migrated request resumes from), or fails it (bad grammar, or
not compiled within the timeout). While it runs, every sampled token goes through `accept`
before its next mask is built by `build_mask`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from radixmesh.common.errors import RadixMeshError, invalid_argument
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.device_io import tensor_to_device, to_device
from radixmesh.engine.grammar.base import BaseGrammarBackend, GrammarMatcher
from radixmesh.engine.grammar.compile_pool import GrammarCompilePool, RemoteGrammarSource
from radixmesh.engine.grammar.jump_forward import advance_matcher, retokenize_jump
from radixmesh.engine.grammar.registry import grammar_backend_class
from radixmesh.engine.grammar.remote import GrammarServiceClient
from radixmesh.engine.grammar.spec import grammar_spec
from radixmesh.engine.grammar.vocab_mask import VocabMask, warm_up_vocab_mask
from radixmesh.engine.request import Req

logger = logging.getLogger(__name__)


@dataclass
class _Compiling:
    req: Req
    future: Future[Any]
    deadline_s: float


class GrammarManager:
    """Owns grammar compilation and the per-request matchers of one scheduler."""

    def __init__(self, config: EngineConfig, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 context_len: int) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = config.grammar_compile_timeout
        # Without the radix cache a jump would recompute the whole sequence: never worth it.
        self.jump_forward_enabled = config.enable_jump_forward and not config.disable_radix_cache
        self.context_len = context_len
        backend_cls = grammar_backend_class(config.grammar_backend)
        threads = config.grammar_compile_threads

        def make_backend() -> BaseGrammarBackend:
            if tokenizer is None:
                raise invalid_argument("structured outputs need the model's tokenizer; this model has none")
            backend: BaseGrammarBackend = backend_cls(tokenizer, vocab_size, list(stop_token_ids),
                                                      num_threads=threads)
            return backend

        remote: RemoteGrammarSource | None = None
        if config.grammar_service and tokenizer is not None:
            remote = GrammarServiceClient(config.grammar_service, tokenizer, vocab_size, stop_token_ids,
                                          timeout_s=config.grammar_compile_timeout)
        self.pool = GrammarCompilePool(make_backend, threads, config.grammar_cache_size, remote)
        self.compiling: list[_Compiling] = []
        self.num_jumps = 0
        self.num_jump_forward_tokens = 0
        self.num_compile_timeouts = 0
        self.vocab_size = vocab_size

    def warm_up(self, device: torch.device) -> None:
        """Compile the device kernel that applies grammar masks, so the first grammar batches do not."""
        if device.type == "cuda" and self.tokenizer is not None and warm_up_vocab_mask(self.vocab_size, device):
            logger.debug("grammar mask kernel compiled")

    # ---- waiting for grammars ---------------------------------------------------------------
    def submit(self, req: Req) -> None:
        """Start or join the compilation of the request's grammar; the request waits here."""
        spec = grammar_spec(req.params)
        assert spec is not None, "submit() needs a request with a grammar"
        self.compiling.append(_Compiling(req, self.pool.get(spec), time.monotonic() + self.timeout_s))

    @property
    def has_compiling(self) -> bool:
        return bool(self.compiling)

    def collect(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """Requests whose grammar is ready (with their matcher set) and requests that failed."""
        if not self.compiling:
            return [], []
        ready: list[Req] = []
        failed: list[tuple[Req, str]] = []
        still: list[_Compiling] = []
        now = time.monotonic()
        for item in self.compiling:
            if item.future.done():
                error = item.future.exception()
                if error is None:
                    item.req.grammar = self.pool.backend.new_matcher(item.future.result())
                    refused = replay_output(item.req)
                    if refused is None:
                        ready.append(item.req)
                    else:
                        failed.append((item.req, refused))
                else:
                    failed.append((item.req, _message(error)))
            elif now >= item.deadline_s:
                self.num_compile_timeouts += 1
                failed.append((item.req, f"the grammar did not compile within {self.timeout_s:g} s "
                                         "(--grammar-compile-timeout); simplify it"))
            else:
                still.append(item)
        self.compiling = still
        return ready, failed

    def remove(self, rid: str) -> list[Req]:
        """Stop waiting for the grammar of request `rid` (abort); the compilation itself goes on."""
        gone = [item.req for item in self.compiling if item.req.rid == rid]
        self.compiling = [item for item in self.compiling if item.req.rid != rid]
        return gone

    def wait(self, timeout_s: float) -> None:
        """Block until some grammar is ready or `timeout_s` passed (when the scheduler is idle)."""
        futures = [item.future for item in self.compiling]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    # ---- decoding ---------------------------------------------------------------------------
    def build_mask(self, reqs: Sequence[Req], rows: list[int], device: torch.device) -> VocabMask:
        """The allowed next tokens of `reqs[row]` for each row in `rows`, on `device`."""
        backend = self.pool.backend
        on_gpu = device.type == "cuda"
        mask = backend.allocate_mask(len(reqs), pinned=on_gpu)
        matchers = [_matcher(reqs[row]) for row in rows]
        backend.fill_masks(matchers, mask, rows)
        # pinned sources: neither copy makes the host wait for the forward pass already queued
        rows_device = to_device(rows, torch.int32, device) if on_gpu else None
        return VocabMask(tensor_to_device(mask, device), rows, rows_device)

    @staticmethod
    def accept(req: Req, token_id: int) -> bool:
        return _matcher(req).accept_token(token_id)

    def may_jump(self, req: Req) -> bool:
        """Jump-forward applies: on, a grammar, and no logprobs (forced tokens have none)."""
        return self.jump_forward_enabled and req.grammar is not None and not req.wants_logprobs

    def jump_forward(self, req: Req) -> list[int] | None:
        """Ids that replace the request's last output token (it plus the forced text), matcher advanced.

        None when nothing is forced, when the jump would not fit the token budget, or when
        the forced text cannot be tokenized consistently.
        """
        if req.futures or self.tokenizer is None or not req.output_ids:
            return None
        matcher = _matcher(req)
        forced = matcher.find_jump_forward_string()
        if not forced:
            return None
        last = req.output_ids[-1]
        new_ids = retokenize_jump(self.tokenizer, last, forced)
        if new_ids is None or len(new_ids) < 2:
            return None
        num_output = len(req.output_ids) - 1 + len(new_ids)
        # room for the token sampled after the jump, within max_new_tokens and the context
        if num_output >= req.params.max_new_tokens or len(req.origin_input_ids) + num_output >= self.context_len:
            return None
        if not advance_matcher(matcher, last, new_ids):
            logger.warning("request %s: the grammar refused the re-tokenized forced text %r", req.rid, forced)
            return None
        self.num_jumps += 1
        self.num_jump_forward_tokens += len(new_ids) - 1
        return new_ids

    def stats(self) -> dict[str, float]:
        pool = self.pool
        return {**pool.compile_time.stats("grammar_compile_seconds"),
                "num_grammar_compiling": len(self.compiling), "num_grammars_compiled": pool.num_compiled,
                "num_grammars_fetched": pool.num_fetched, "num_grammar_cache_hits": pool.num_cache_hits,
                "num_grammar_service_failures": pool.num_remote_failures,
                "num_grammar_compile_timeouts": self.num_compile_timeouts, "num_jump_forwards": self.num_jumps,
                "num_jump_forward_tokens": self.num_jump_forward_tokens}

    def shutdown(self) -> None:
        self.pool.shutdown()


def replay_output(req: Req) -> str | None:
    """Advance a fresh matcher over the output a migrated request resumes from (the state, jump-forward
    included, is then the one its first worker had); why not when the grammar refuses it (None: accepted)."""
    matcher = _matcher(req)
    for pos, token_id in enumerate(req.output_ids):
        if not matcher.accept_token(token_id):
            return f"the grammar refuses resumed output token {token_id} at position {pos}"
    if req.output_ids and matcher.is_terminated():
        return "the resumed output already ends the grammar"
    return None


def _message(error: BaseException) -> str:
    if isinstance(error, RadixMeshError):
        return error.message
    return f"grammar compilation failed: {type(error).__name__}: {error}"


def _matcher(req: Req) -> GrammarMatcher:
    assert req.grammar is not None, f"request {req.rid} has no grammar"
    return req.grammar
