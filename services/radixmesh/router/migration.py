"""Migration of a Generate stream: what a relay (the router, the gateway's embedded router, the gateway in
front of router replicas) needs to continue a stream that broke after tokens reached the client.

The relay keeps a `StreamProgress` per request: every message it forwards goes through `observe`, which
records the output token ids and makes a later leg's messages read as the stream's own (the request's id,
the first leg's cached-prompt count). `next_request` is what the next worker gets: the first time the
request itself; after tokens were forwarded a copy with `resume_output_ids` = those tokens, under a leg id
of its own (`<id>~<n>`), without prompt log-probs (already sent) and without a prefill worker or peer
prefix (the new worker computes prompt and output itself, reusing its prefix cache). The worker continues
the sequence exactly: seeded draws are keyed by (seed, output position), penalties and stop conditions see
the resumed tokens as output, a grammar's matcher replays them, and completion_tokens counts them, so the
client sees one stream with no token lost or repeated.

Not resumable: prefill-only calls, prompts with images (their features would be encoded again), and a
stream that already ended. Each choice of an n > 1 request is its own Generate call and migrates alone.
"""

from __future__ import annotations

from radixmesh.protocol import worker_pb2

LEG_SEPARATOR = "~"
"""Between a request's id and its leg number in the id a later leg runs under on a worker."""


class StreamProgress:
    """What one Generate stream delivered so far, and the request that continues it elsewhere."""

    def __init__(self, request: worker_pb2.GenerateRequest, leg_tag: str = "") -> None:
        """`leg_tag`: prefix of the leg numbers (a gateway uses "g" so that its legs and a router's never
        share an id)."""
        self.request = request
        self.output_ids: list[int] = list(request.resume_output_ids)
        """Output token ids the client has, in order (a request that resumes already starts with some)."""
        self.num_resumes = 0
        """Resumptions so far (each after new tokens; retries of one resumption share it)."""
        self.leg_tag = leg_tag
        self.finished = False
        self._resumed_at = len(self.output_ids)
        self._cached_tokens: int | None = None
        self._leg_started = False

    @property
    def num_sent(self) -> int:
        """Output tokens forwarded by this relay (not counting those the request resumed from)."""
        return len(self.output_ids) - len(self.request.resume_output_ids)

    @property
    def leg_id(self) -> str:
        """The id the current leg runs under on its worker (the request's own until a resumption)."""
        rid = self.request.request_id
        return rid if not self.num_resumes else f"{rid}{LEG_SEPARATOR}{self.leg_tag}{self.num_resumes}"

    def can_resume(self) -> bool:
        """Whether a break now can be continued elsewhere."""
        request = self.request
        budget = request.sampling_params.max_new_tokens if request.sampling_params.HasField("max_new_tokens") \
            else None
        return (not self.finished and not request.prefill_only and not request.images
                and (budget is None or len(self.output_ids) < budget))

    def next_request(self) -> worker_pb2.GenerateRequest:
        """The request for the next try: the request itself until tokens were forwarded, then its resumption
        from them (a new leg id after new tokens; a retry of the same resumption keeps its id)."""
        self._leg_started = False
        if self.num_sent == 0:
            return self.request
        if len(self.output_ids) != self._resumed_at:
            self._resumed_at = len(self.output_ids)
            self.num_resumes += 1
        request = worker_pb2.GenerateRequest()
        request.CopyFrom(self.request)
        request.request_id = self.leg_id
        request.resume_output_ids[:] = self.output_ids
        request.sampling_params.ClearField("logprob_start_len")  # the prompt's log-probs went with the first leg
        request.ClearField("prefill")
        request.ClearField("peer_prefix")
        return request

    def observe(self, msg: worker_pb2.GenerateResponse) -> worker_pb2.GenerateResponse:
        """Record a message the client is about to get; returns it as the stream's own."""
        self.output_ids.extend(msg.token_ids)
        msg.request_id = self.request.request_id
        if self._cached_tokens is None:
            self._cached_tokens = msg.cached_tokens
        else:
            msg.cached_tokens = self._cached_tokens  # usage counts the prompt once, as its first worker served it
        if self.num_resumes and not self._leg_started:
            msg.ClearField("engine_ttft_s")  # the time to first token was the first leg's
        self._leg_started = True
        if msg.finish_reason:
            self.finished = True
        return msg
