"""Where the router learns which workers exist: static lists, Redis leases, Kubernetes pods."""
