"""When a request is done: EOS, stop token ids, stop strings, max_new_tokens, context length."""

from __future__ import annotations

from typing import Any

from radixmesh.engine.detokenizer import find_stop_string
from radixmesh.engine.request import FinishReason, Req


def check_finished(req: Req, eos_ids: set[int], context_len: int,
                   tokenizer: Any) -> tuple[FinishReason | None, str | int | None]:
    """Finish reason and matched stop (string or token id) after the newest token, or (None, None)."""
    params = req.params
    last = req.output_ids[-1]
    if len(req.output_ids) >= params.min_new_tokens:
        if last in params.stop_token_ids:
            return FinishReason.STOP, last
        if not params.ignore_eos and last in eos_ids:
            return FinishReason.STOP, last
    if params.stop and tokenizer is not None:
        matched = find_stop_string(tokenizer, req.output_ids, params.stop, params.skip_special_tokens)
        if matched is not None:
            return FinishReason.STOP, matched
    if len(req.output_ids) >= params.max_new_tokens:
        return FinishReason.LENGTH, None
    if len(req.origin_input_ids) + len(req.output_ids) >= context_len:
        return FinishReason.LENGTH, None
    return None, None
