"""Health of one worker from active probes, with thresholds so one blip does not flap it.

A new worker starts unhealthy and becomes healthy after `success_threshold` passed probes;
a healthy one becomes unhealthy after `failure_threshold` consecutive failures.
"""

from __future__ import annotations

from radixmesh.router.config import HealthConfig


class HealthState:
    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self.healthy = False
        self.consecutive_failures = 0
        self.consecutive_successes = 0
        self.last_error = ""
        self.num_probes = 0

    def on_probe(self, ok: bool, error: str = "") -> bool:
        """Record one probe; returns True when the healthy flag changed."""
        self.num_probes += 1
        if ok:
            self.consecutive_successes += 1
            self.consecutive_failures = 0
            self.last_error = ""
            if not self.healthy and self.consecutive_successes >= self.config.success_threshold:
                self.healthy = True
                return True
            return False
        self.consecutive_failures += 1
        self.consecutive_successes = 0
        self.last_error = error
        if self.healthy and self.consecutive_failures >= self.config.failure_threshold:
            self.healthy = False
            return True
        return False

    def mark_down(self, error: str) -> bool:
        """A request saw the worker unreachable: unhealthy at once (the probes bring it back)."""
        self.consecutive_successes = 0
        self.last_error = error
        changed, self.healthy = self.healthy, False
        return changed
