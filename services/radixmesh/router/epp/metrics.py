"""Prometheus metrics of the endpoint picker (on the router's --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

_FINE_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0003, 0.0004, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005,
                 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

PICK = Histogram("radixmesh_epp_pick_seconds",
                 "Time of one pick, tokenization excluded: candidates, the policy (index lookup included) and the "
                 "answer to the proxy", buckets=_FINE_BUCKETS)
TOKENIZE = Histogram("radixmesh_epp_tokenize_seconds", "Time to get a request's token ids and block hashes",
                     buckets=_FINE_BUCKETS)
PICKS = Counter("radixmesh_epp_picks_total", "Endpoint picks by result: picked | shed (429) | unavailable (503)",
                ["result"])
RESULTS = ("picked", "shed", "unavailable")
PROMPTS = Counter("radixmesh_epp_prompts_total",
                  "Picked requests by where their blocks came from: tokenized (here) | tokenized-service | token-ids | "
                  "none | tokenizer-error",
                  ["source"])
