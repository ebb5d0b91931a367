"""The worker runtime: model, loader, memory pools, radix cache, scheduler, sampling."""
