"""A per-worker circuit breaker: closed -> open after consecutive failures -> half-open trial -> closed.

While open, the worker gets no requests. After `open_s` one trial request may pass
(half-open); its success closes the circuit, its failure reopens it for twice as long
(capped). The clock is injectable so the state machine is tested without sleeping.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

from radixmesh.router.config import BreakerConfig


class CircuitState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class CircuitBreaker:
    def __init__(self, config: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._state = CircuitState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._open_s = config.open_s
        self._trial_in_flight = False

    @property
    def state(self) -> CircuitState:
        if self._state is CircuitState.OPEN and self.clock() - self._opened_at >= self._open_s:
            self._state = CircuitState.HALF_OPEN
            self._trial_in_flight = False
        return self._state

    def can_route(self) -> bool:
        """May a request go to this worker now? (Does not reserve the half-open trial.)"""
        state = self.state
        return state is CircuitState.CLOSED or (state is CircuitState.HALF_OPEN and not self._trial_in_flight)

    def on_dispatch(self) -> bool:
        """A request was sent; in half-open state it is the one trial (returns whether it is)."""
        if self.state is CircuitState.HALF_OPEN and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        return False

    def end_trial(self) -> None:
        """The trial request ended without a verdict (its caller left, the worker drained): the next request may be
        the trial. A no-op once its success or failure moved the circuit on."""
        if self._state is CircuitState.HALF_OPEN:
            self._trial_in_flight = False

    def on_success(self) -> None:
        self._failures = 0
        if self._state is not CircuitState.CLOSED:
            self._state = CircuitState.CLOSED
            self._open_s = self.config.open_s
            self._trial_in_flight = False

    def on_failure(self) -> None:
        state = self.state
        if state is CircuitState.HALF_OPEN:
            self._open(min(self._open_s * 2, self.config.max_open_s))
            return
        self._failures += 1
        if state is CircuitState.CLOSED and self._failures >= self.config.failure_threshold:
            self._open(self.config.open_s)

    def _open(self, open_s: float) -> None:
        self._state = CircuitState.OPEN
        self._opened_at = self.clock()
        self._open_s = open_s
        self._trial_in_flight = False
        self._failures = 0
