"""Structured outputs: grammar specs, backends (xgrammar), compilation and jump-forward decoding."""
