"""The Redis-backed KV-cache index: block hashes, the workers' writer and the routers' reader."""
