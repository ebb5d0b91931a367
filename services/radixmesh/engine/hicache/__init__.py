"""Hierarchical KV cache: a host-memory tier under the device pool (`--enable-hierarchical-cache`)."""
