"""Per-request sampling parameters: the typed message that crosses every process boundary into the scheduler."""

from __future__ import annotations

import math
from collections.abc import Sized
from dataclasses import dataclass

import msgspec

from radixmesh.common.errors import invalid_argument


@dataclass(frozen=True)
class SamplingLimits:
    """Bounds on one request's sampling parameters, checked before admission on every transport."""

    max_n: int = 128
    """Most completions (branches) per prompt."""
    max_top_logprobs: int = 20
    """Most alternatives per position in top logprobs (OpenAI's limit)."""
    max_stop_strings: int = 16
    """Most stop strings per request."""
    max_stop_str_len: int = 1024
    """Longest stop string, in characters (the detokenizer holds back this much text)."""
    max_stop_token_ids: int = 1024
    """Most extra stop token ids per request."""
    max_logit_bias: int = 1024
    """Most entries in logit_bias."""
    max_abs_seed: int = 1 << 62
    """Seeds lie in (-max_abs_seed, max_abs_seed), so derived branch seeds still fit in int64."""


LIMITS = SamplingLimits()
INT32_MAX = (1 << 31) - 1
"""Counts and positions cross the wire and reach the device as 32-bit integers (top_k above the
vocabulary simply keeps every token)."""
MAX_TOP_LOGPROBS = LIMITS.max_top_logprobs


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick tokens for one request. Defaults follow SGLang's native API."""

    max_new_tokens: int = 128
    """Upper bound on generated tokens (>= 1; the engine uses 0 internally to cache a prompt)."""
    min_new_tokens: int = 0
    """EOS and stop token ids are masked until this many tokens were generated."""
    temperature: float = 1.0
    """0 means greedy; must be >= 0."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top probability; in [0, 1]."""
    frequency_penalty: float = 0.0
    """Subtracted once per previous occurrence in the output; in [-2, 2]."""
    presence_penalty: float = 0.0
    """Subtracted once if the token occurred in the output; in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens seen in prompt or output; > 0."""
    stop: tuple[str, ...] = ()
    """Stop strings; the output text is cut before the first match."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that finish the request (kept out of the text)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token."""
    seed: int | None = None
    """Same seed, same prompt, same parameters: same output, whatever else is batched."""
    n: int = 1
    """Number of completions; branches share the prompt's KV cache."""
    logprobs: bool = False
    """Return the log probability of each generated token."""
    top_logprobs: int = 0
    """Also return this many most likely alternatives per position (0..20)."""
    logprob_start_len: int = -1
    """Also return the log-probs of prompt tokens from this position on (raw model logits); -1: none."""
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    """Token id -> additive bias in [-100, 100] applied to the logits."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    json_schema: str | None = None
    """Structured output: JSON matching this JSON Schema (text); "$$ANY$$" means any JSON object or array."""
    regex: str | None = None
    """Structured output: text that fully matches this regular expression."""
    ebnf: str | None = None
    """Structured output: a sentence of this EBNF grammar (start rule `root`)."""
    structural_tag: str | None = None
    """Structured output: an xgrammar structural tag (JSON text), e.g. free text with constrained tool calls."""

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `RadixMeshError(INVALID_ARGUMENT)` naming the first bad field (a grammar's syntax is the
        engine's to check: radixmesh.engine.sampling.validation)."""
        _check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1", self.max_new_tokens)
        _check(0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
               "must be in [0, max_new_tokens]", self.min_new_tokens)
        _check(_finite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0",
               self.temperature)
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(-1 <= self.top_k <= INT32_MAX, "top_k", "must be -1 (disabled) or >= 1", self.top_k)
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, name, "must be in [-2, 2]", value)
        _check(_finite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
               "repetition_penalty", "must be in (0, 10]", self.repetition_penalty)
        _check(1 <= self.n <= LIMITS.max_n, "n", f"must be in [1, {LIMITS.max_n}]", self.n)
        _check(0 <= self.top_logprobs <= LIMITS.max_top_logprobs, "top_logprobs",
               f"must be in [0, {LIMITS.max_top_logprobs}]", self.top_logprobs)
        _check(-1 <= self.logprob_start_len <= INT32_MAX, "logprob_start_len", "must be -1 (none) or >= 0",
               self.logprob_start_len)
        _check(self.seed is None or abs(self.seed) < LIMITS.max_abs_seed, "seed",
               "must be in (-2**62, 2**62)", self.seed)
        self._validate_stops(vocab_size)
        self._validate_logit_bias(vocab_size)

    def _validate_stops(self, vocab_size: int | None) -> None:
        _check_count(self.stop, LIMITS.max_stop_strings, "stop", "stop strings")
        for stop in self.stop:
            _check(isinstance(stop, str) and bool(stop), "stop", "must be non-empty strings", stop)
            _check(len(stop) <= LIMITS.max_stop_str_len, "stop",
                   f"each stop string may have at most {LIMITS.max_stop_str_len} characters", _preview(stop))
        _check_count(self.stop_token_ids, LIMITS.max_stop_token_ids, "stop_token_ids", "stop token ids")
        if vocab_size is not None:
            for token_id in self.stop_token_ids:
                _check(0 <= token_id < vocab_size, "stop_token_ids",
                       f"token ids must be in [0, {vocab_size})", token_id)

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        _check_count(self.logit_bias, LIMITS.max_logit_bias, "logit_bias", "entries")
        for token_id, bias in self.logit_bias.items():
            _check(_finite(bias) and -100 <= bias <= 100, "logit_bias", "biases must be in [-100, 100]",
                   bias)
            if vocab_size is not None:
                _check(0 <= token_id < vocab_size, "logit_bias", f"token ids must be in [0, {vocab_size})",
                       token_id)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_grammar(self) -> bool:
        """The output is constrained by json_schema, regex, ebnf or structural_tag."""
        return (self.json_schema is not None or self.regex is not None or self.ebnf is not None
                or self.structural_tag is not None)

    @property
    def has_penalties(self) -> bool:
        return (self.frequency_penalty != 0 or self.presence_penalty != 0
                or self.repetition_penalty != 1.0)


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _check(ok: bool, param: str, rule: str, value: object) -> None:
    if not ok:
        raise invalid_argument(f"invalid {param}={value!r}: {rule}", param=param)


def _check_count(items: Sized, limit: int, param: str, what: str) -> None:
    if len(items) > limit:
        raise invalid_argument(f"invalid {param}: {len(items)} {what}, at most {limit} allowed", param=param)


def _preview(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
