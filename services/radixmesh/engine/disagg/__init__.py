"""Prefill/decode disaggregation inside the scheduler process: reservations, exports, KV transports."""
