"""Jump-forward decoding: when the grammar forces a string, append it without a pass per token.

Shaped after SGLang's compressed FSM: the forced text is joined to the text of the token
just sampled and the two are tokenized together, so the boundary gets the tokens the
model would have seen in natural text (`{` + `"name": ` becomes `{"`, `name`, `":`
rather than `{`, `"`, `name`, ...). Only that one token is re-tokenized: it is the only
one not yet sent to the client. The matcher is rolled back over the replaced token and
advanced over the new ones; if anything disagrees, nothing changes.
"""

from __future__ import annotations

from typing import Any

from radixmesh.engine.grammar.base import GrammarMatcher


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def retokenize_jump(tokenizer: Any, last_id: int, forced: str) -> list[int] | None:
    """Ids replacing `last_id` whose text is `text(last_id) + forced`; None if no tokenization fits."""
    tail = _decode(tokenizer, [last_id])
    if "\ufffd" not in tail:  # a whole character: safe to tokenize with what follows
        ids = _encode(tokenizer, tail + forced)
        if ids and _decode(tokenizer, ids) == tail + forced:
            return ids
    ids = _encode(tokenizer, forced)
    if ids and _decode(tokenizer, ids) == forced:
        return [last_id, *ids]
    return None


def advance_matcher(matcher: GrammarMatcher, last_id: int, new_ids: list[int]) -> bool:
    """Move a matcher that accepted `last_id` onto `new_ids` instead; False (state kept) on refusal."""
    rolled_back = new_ids[0] != last_id
    todo = new_ids if rolled_back else new_ids[1:]
    if rolled_back:
        matcher.rollback(1)
    for count, token_id in enumerate(todo):
        if not matcher.accept_token(token_id):
            if count:
                matcher.rollback(count)
            if rolled_back:
                accepted = matcher.accept_token(last_id)
                assert accepted, "the matcher refused a token it had accepted before the rollback"
            return False
    return True
