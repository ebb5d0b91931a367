"""Triton kernels (imported as `radixmesh.kernels`); they import only torch and triton."""
