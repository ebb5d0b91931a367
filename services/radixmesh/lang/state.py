"""A running program's state: its text, variables and chat roles, and the thread that runs it.

`s += expr` queues `expr`; a short-lived executor thread per state runs the queue in order
and exits when it is empty. Reading (`s["name"]`, `s.text()`) waits for the queue to drain.
So the branches of `s.fork(n)` run their LLM calls concurrently while the program itself
reads as straight-line code.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from radixmesh.common.errors import invalid_argument
from radixmesh.lang.backend import BaseBackend
from radixmesh.lang.ir import ROLES, Concat, Expr, Gen, GenParams, RoleBegin, RoleEnd, Select, Text, as_expr

_END = object()


@dataclass
class _Join(Expr):
    """Queued on the parent by `ProgramStateGroup.join`: wait for the branches, then merge them."""

    group: ProgramStateGroup
    mode: str


@dataclass
class _Snapshot:
    """What a branch copies from its parent at the fork."""

    text: str = ""
    variables: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)
    roles: tuple[str, ...] = ()
    messages: list[dict[str, str]] = field(default_factory=list)
    open_role: tuple[str, str, int] | None = None
    """(role, closing text, where its content starts) of an unclosed role block."""


class ProgramState:
    """The state `s` a program function receives; see the module docstring for how it runs."""

    def __init__(self, backend: BaseBackend, defaults: GenParams, stream: bool = False,
                 snapshot: _Snapshot | None = None) -> None:
        self.backend = backend
        self.defaults = defaults
        self._s = snapshot or _Snapshot()
        self._fork_point = _Snapshot(self._s.text, dict(self._s.variables), {}, self._s.roles,
                                     list(self._s.messages))
        self._pending: deque[Expr] = deque()
        self._cond = threading.Condition()
        self._running = False
        self._error: BaseException | None = None
        self._chunks: queue.Queue[object] | None = queue.Queue() if stream else None

    # ---- writing ------------------------------------------------------------------------------
    def __iadd__(self, other: Expr | str) -> ProgramState:
        self.submit(as_expr(other))
        return self

    def submit(self, expr: Expr) -> None:
        """Queue `expr`; an executor thread runs the queue in order."""
        with self._cond:
            if self._error is not None:
                return  # the program already failed; sync() reports it
            self._pending.append(expr)
            if not self._running:
                self._running = True
                threading.Thread(target=self._drain, name="radixmesh-lang-state", daemon=True).start()

    @contextlib.contextmanager
    def _role_block(self, role: str) -> Iterator[None]:
        self.submit(RoleBegin(role))
        yield
        self.submit(RoleEnd(role))

    def system(self) -> contextlib.AbstractContextManager[None]:
        """`with s.system(): s += ...` writes one system message."""
        return self._role_block("system")

    def user(self) -> contextlib.AbstractContextManager[None]:
        return self._role_block("user")

    def assistant(self) -> contextlib.AbstractContextManager[None]:
        return self._role_block("assistant")

    def fork(self, num_branches: int) -> ProgramStateGroup:
        """`num_branches` states that continue from this one's text; their calls run concurrently.

        The shared text is computed once first, so every branch's prompt hits the prefix cache.
        """
        if num_branches < 1:
            raise invalid_argument(f"fork needs at least one branch (got {num_branches})", "num_branches")
        self.sync()
        if num_branches > 1 and self._s.text:
            self.backend.cache_prefix(self._s.text)
        s = self._s
        branches = [ProgramState(self.backend, self.defaults, snapshot=_Snapshot(
            s.text, dict(s.variables), dict(s.meta_info), s.roles, list(s.messages), s.open_role))
            for _ in range(num_branches)]
        return ProgramStateGroup(branches, self)

    # ---- reading ------------------------------------------------------------------------------
    def sync(self) -> None:
        """Wait until everything queued has run; raise the program's error, if any."""
        with self._cond:
            self._cond.wait_for(lambda: not self._running)
            if self._error is not None:
                raise self._error

    def __getitem__(self, name: str) -> Any:
        self.sync()
        if name not in self._s.variables:
            raise KeyError(f"no variable {name!r}; the program set {sorted(self._s.variables)}")
        return self._s.variables[name]

    def get_var(self, name: str, default: Any = None) -> Any:
        self.sync()
        return self._s.variables.get(name, default)

    def get_meta_info(self, name: str) -> Any:
        """What the server reported for the gen or select stored under `name` (timings included)."""
        self.sync()
        return self._s.meta_info.get(name)

    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self._s.variables)

    def text(self) -> str:
        self.sync()
        return self._s.text

    def messages(self) -> list[dict[str, str]]:
        """The closed role blocks as chat messages ({role, content})."""
        self.sync()
        return [dict(m) for m in self._s.messages]

    def text_iter(self) -> Iterator[str]:
        """The program's text in pieces as it is written (for `run(stream=True)`); raises its error at the end."""
        if self._chunks is None:
            raise invalid_argument("this state does not stream; run the program with stream=True", "stream")
        while (chunk := self._chunks.get()) is not _END:
            assert isinstance(chunk, str)
            yield chunk
        self.sync()

    def __iter__(self) -> Iterator[str]:
        return self.text_iter()

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"

    @property
    def streams(self) -> bool:
        return self._chunks is not None

    def end_stream(self) -> None:
        """Mark the streamed text complete (the program function returned or failed)."""
        if self._chunks is not None:
            self._chunks.put(_END)

    def fail(self, error: BaseException) -> None:
        """Record an error raised by the program function itself."""
        with self._cond:
            self._error = self._error or error

    # ---- the executor -------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._pending or self._error is not None:
                    self._pending.clear()
                    self._running = False
                    self._cond.notify_all()
                    return
                expr = self._pending.popleft()
            try:
                self._execute(expr)
            except BaseException as exc:  # reported by the next sync(), in the program's thread
                with self._cond:
                    self._error = exc

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._append(expr.text)
        elif isinstance(expr, Concat):
            for part in expr.parts:
                self._execute(part)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._begin_role(expr.role)
        elif isinstance(expr, RoleEnd):
            self._end_role(expr.role)
        elif isinstance(expr, _Join):
            self._join(expr.group, expr.mode)
        else:
            raise TypeError(f"cannot run {type(expr).__name__}")

    def _append(self, text: str, emit: bool = True) -> None:
        self._s.text += text
        if emit and text and self._chunks is not None:
            self._chunks.put(text)

    def _store(self, name: str | None, value: Any, meta: Any) -> None:
        if name is not None:
            self._s.variables[name] = value
            self._s.meta_info[name] = meta

    def _gen(self, expr: Gen) -> None:
        on_text = self._chunks.put if self._chunks is not None else None
        result = self.backend.generate(self._s.text, expr.params.merged_over(self.defaults), on_text)
        self._append(result.text, emit=on_text is None)
        self._store(expr.name, result.text, {**result.meta_info, "start_s": result.start_s, "end_s": result.end_s})

    def _select(self, expr: Select) -> None:
        start_s = time.perf_counter()
        result = self.backend.select(self._s.text, expr.choices)
        choice = expr.choices[result.index]
        self._append(choice)
        self._store(expr.name, choice, {"choices": list(expr.choices), "logprobs": result.logprobs,
                                        "normalized_logprobs": result.normalized_logprobs,
                                        "num_tokens": result.num_tokens, "start_s": start_s,
                                        "end_s": time.perf_counter()})

    def _begin_role(self, role: str) -> None:
        if role not in ROLES:
            raise invalid_argument(f"unknown role {role!r}; use one of {', '.join(ROLES)}", "role")
        if self._s.open_role is not None:
            raise invalid_argument(f"a {role} block cannot start inside the open {self._s.open_role[0]} block", "role")
        opening, closing = self.backend.role_markers(self._s.roles, role)
        self._append(opening)
        self._s.open_role = (role, closing, len(self._s.text))

    def _end_role(self, role: str) -> None:
        open_role = self._s.open_role
        if open_role is None or open_role[0] != role:
            raise invalid_argument(f"no open {role} block to close", "role")
        _, closing, start = open_role
        self._s.messages.append({"role": role, "content": self._s.text[start:]})
        self._s.roles += (role,)
        self._s.open_role = None
        self._append(closing)

    def _join(self, group: ProgramStateGroup, mode: str) -> None:
        for branch in group:
            branch.sync()
        names = [name for branch in group for name in branch._new_variables() if name]
        for name in dict.fromkeys(names):
            self._s.variables[name] = [branch._s.variables.get(name) for branch in group]
            self._s.meta_info[name] = [branch._s.meta_info.get(name) for branch in group]
        if mode == "concat":
            for branch in group:
                self._append(branch._s.text[len(branch._fork_point.text):])
                self._s.messages += branch._s.messages[len(branch._fork_point.messages):]
                self._s.roles += branch._s.roles[len(branch._fork_point.roles):]

    def _new_variables(self) -> list[str]:
        """Names this branch set or changed since the fork."""
        before = self._fork_point.variables
        return [name for name, value in self._s.variables.items() if name not in before or before[name] is not value]


JOIN_MODES = ("gather", "concat")


class ProgramStateGroup:
    """The branches of one fork; iterate over them, index them, and `join` them back."""

    def __init__(self, branches: list[ProgramState], parent: ProgramState) -> None:
        self.branches = branches
        self.parent = parent

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.branches)

    def __getitem__(self, index: int) -> ProgramState:
        return self.branches[index]

    def __setitem__(self, index: int, value: ProgramState) -> None:
        """Only for `branches[i] += expr`, which hands back the same branch."""
        if value is not self.branches[index]:
            raise TypeError("the branches of a fork cannot be replaced")

    def __len__(self) -> int:
        return len(self.branches)

    def join(self, mode: str = "gather") -> None:
        """Merge the branches into the parent once they finish (queued on the parent, in order).

        `gather`: each variable a branch set becomes a list in the parent, one value per branch.
        `concat`: also append each branch's new text (and chat messages) to the parent, in order.
        """
        if mode not in JOIN_MODES:
            raise invalid_argument(f"join mode must be one of {', '.join(JOIN_MODES)} (got {mode!r})", "mode")
        self.parent.submit(_Join(self, mode))
