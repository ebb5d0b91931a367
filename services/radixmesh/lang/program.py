"""`@function` programs and how they run: one at a time, streamed, or as a batch on threads."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixmesh.common.errors import invalid_argument
from radixmesh.lang.backend import BaseBackend, get_default_backend
from radixmesh.lang.ir import GenParams
from radixmesh.lang.state import ProgramState

DEFAULT_MAX_TOKENS = 128
MAX_AUTO_THREADS = 16


class Program:
    """A program function `f(s, *args)`; `run` gives it a fresh state and returns that state."""

    def __init__(self, func: Callable[..., Any]) -> None:
        params = list(inspect.signature(func).parameters)
        if not params:
            raise invalid_argument(f"program {func.__name__} must take the state as its first argument", "func")
        self.func = func
        self.arg_names = params[1:]
        self.name = func.__name__
        self.__doc__ = func.__doc__

    def __repr__(self) -> str:
        return f"Program({self.name})"

    def run(self, *args: Any, backend: BaseBackend | None = None, stream: bool = False,
            max_tokens: int = DEFAULT_MAX_TOKENS, temperature: float | None = None, seed: int | None = None,
            **kwargs: Any) -> ProgramState:
        """Run the program; `max_tokens`, `temperature` and `seed` are defaults for its `gen` calls.

        With `stream=True` the program runs on a thread and the state returns at once: iterate
        over it (`for chunk in state`) to get its text as it is written.
        """
        defaults = GenParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        state = ProgramState(backend or get_default_backend(), defaults, stream=stream)
        if stream:
            threading.Thread(target=self._execute, args=(state, args, kwargs), name="radixmesh-lang-program",
                             daemon=True).start()
        else:
            self._execute(state, args, kwargs)
            state.sync()
        return state

    def run_batch(self, batch_kwargs: Sequence[dict[str, Any]], *, backend: BaseBackend | None = None,
                  num_threads: int | str = "auto", max_tokens: int = DEFAULT_MAX_TOKENS,
                  temperature: float | None = None, seed: int | None = None) -> list[ProgramState]:
        """Run the program once per argument dict on `num_threads` threads; states in input order.

        The first program that fails raises its error once all have finished.
        """
        if num_threads == "auto":
            num_threads = max(1, min(len(batch_kwargs), MAX_AUTO_THREADS))
        if not isinstance(num_threads, int) or num_threads < 1:
            raise invalid_argument(f"num_threads must be 'auto' or >= 1 (got {num_threads!r})", "num_threads")
        chosen = backend or get_default_backend()

        def one(kwargs: dict[str, Any]) -> ProgramState:
            return self.run(backend=chosen, max_tokens=max_tokens, temperature=temperature, seed=seed, **kwargs)

        with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="radixmesh-lang-batch") as pool:
            futures = [pool.submit(one, dict(kwargs)) for kwargs in batch_kwargs]
            errors = [f.exception() for f in futures]
        first_error = next((e for e in errors if e is not None), None)
        if first_error is not None:
            raise first_error
        return [f.result() for f in futures]

    def _execute(self, state: ProgramState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self.func(state, *args, **kwargs)
            state.sync()
        except BaseException as exc:
            state.fail(exc)
            if not state.streams:
                raise
        finally:
            state.end_stream()


def function(func: Callable[..., Any]) -> Program:
    """Make `func(s, ...)` a program: `func.run(...)`, `func.run_batch([...])`."""
    return Program(func)
