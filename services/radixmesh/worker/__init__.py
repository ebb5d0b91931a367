"""The gRPC worker service: one engine (its scheduler process) behind WorkerService."""
