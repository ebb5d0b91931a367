"""Tensor parallelism: one worker's forward pass split over several rank processes (docs/tensor-parallel.md)."""
