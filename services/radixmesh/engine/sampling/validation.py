"""The checks a generation request gets before admission, whichever transport brought it: its sampling
parameters (with the grammar's syntax, read by the grammar backend) and its prompt against the model."""

from __future__ import annotations

from collections.abc import Sequence

from radixmesh.common.errors import invalid_argument
from radixmesh.wire.sampling import SamplingParams


def validate_params(params: SamplingParams, vocab_size: int | None = None) -> None:
    """`SamplingParams.validate`, then the grammar's syntax (one grammar at most, one the grammar backend can
    read; no tokenizer needed)."""
    params.validate(vocab_size)
    if params.has_grammar:
        from radixmesh.engine.grammar.registry import check_grammar_syntax
        from radixmesh.engine.grammar.spec import grammar_spec

        spec = grammar_spec(params)
        if spec is not None:
            check_grammar_syntax(spec)


def validate_request(input_ids: Sequence[int], params: SamplingParams, vocab_size: int, context_len: int,
                     generates: bool = True) -> None:
    """Every check a generation request gets before admission, whichever transport brought it.

    The output budget follows OpenAI and SGLang: prompt + max_new_tokens beyond the context
    length is refused (not clipped), naming max_new_tokens. `generates` False (prefill only)
    skips that check.
    """
    validate_params(params, vocab_size)
    if not input_ids:
        raise invalid_argument("the prompt is empty", "prompt")
    prompt_len = len(input_ids)
    if prompt_len >= context_len:
        raise invalid_argument(f"the prompt has {prompt_len} tokens, but the context length is "
                               f"{context_len}; shorten the prompt", "prompt")
    if min(input_ids) < 0 or max(input_ids) >= vocab_size:
        raise invalid_argument(f"input_ids must be in [0, {vocab_size})", "input_ids")
    if params.logprob_start_len >= prompt_len:
        raise invalid_argument(f"logprob_start_len={params.logprob_start_len} must be below the prompt's "
                               f"{prompt_len} tokens", "logprob_start_len")
    room = context_len - prompt_len
    if generates and params.max_new_tokens > room:
        raise invalid_argument(f"max_new_tokens={params.max_new_tokens} is too large: the prompt has {prompt_len} "
                               f"tokens and the context length is {context_len}, so at most {room} tokens can "
                               "be generated", "max_new_tokens")


def validate_resume(output_ids: Sequence[int], params: SamplingParams, vocab_size: int) -> None:
    """Checks of the output a migrated request resumes from: ids in the vocabulary, and budget left."""
    if not output_ids:
        return
    if min(output_ids) < 0 or max(output_ids) >= vocab_size:
        raise invalid_argument(f"resume_output_ids must be in [0, {vocab_size})", "resume_output_ids")
    if len(output_ids) >= params.max_new_tokens:
        raise invalid_argument(f"{len(output_ids)} tokens were generated already: max_new_tokens="
                               f"{params.max_new_tokens} leaves none to resume", "resume_output_ids")
