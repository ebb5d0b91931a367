"""`radixmesh cluster`: a whole local cluster (Redis, workers, tokenizer, router, gateway) on 127.0.0.1."""
