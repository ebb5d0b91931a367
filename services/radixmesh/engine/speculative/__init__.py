"""Speculative decoding: propose draft tokens, verify them in one target extend pass, keep the accepted prefix.

`SpecDecoder` (decoder.py) is the scheduler's only contact: it builds the decode step's batch (a
`VerifyBatch` when drafts were proposed), launches its verification and settles each request's KV
once the accepted tokens are appended. Proposers (ngram, draft model) sit behind `BaseProposer`
in a registry; `AdaptivePolicy` decides per request and per batch size how many drafts pay.
"""
