"""Fault injection against a local cluster: the harness, the load, the proxy and the scenarios."""
