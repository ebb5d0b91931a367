"""The gRPC router: policies, discovery, health checks, retries and circuit breakers."""
