"""One lazy registry for every plug-in point: a kebab-case id maps to a "module:attribute" imported on first use.

Attention backends, grammar backends, model families, quantization methods, speculative proposers, KV
transports, routing policies, tool-call and reasoning parsers, loadtest workloads, scheduler hooks and the
command lists all use it: the CLI and the Helm chart take the same ids, and listing them (`ids`) imports
nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, Generic, TypeVar

from radixmesh.common.errors import invalid_argument

T = TypeVar("T")
ErrorFactory = Callable[[str, "str | None"], Exception]


class LazyRegistry(MutableMapping[str, str], Generic[T]):
    """`id -> "module:attribute"`; `load(id)` imports the module and returns the attribute (a class, a
    factory or an instance). As a mapping it holds the targets: `ids`, `in`, `sorted(...)` import nothing, and
    `registry[id] = "module:attribute"` adds a plug-in (or a test's stand-in).

    `kind` names the plug-in point in errors ("unknown attention backend 'x' (known: ...)"), `param` the
    option that takes the ids; `error` builds the exception (INVALID_ARGUMENT by default). With
    `dashes_for_underscores`, `torch_native` finds `torch-native` (ids once spelt with underscores).
    """

    def __init__(self, kind: str, targets: dict[str, str], param: str | None = None,
                 error: ErrorFactory = invalid_argument, dashes_for_underscores: bool = False) -> None:
        self.kind = kind
        self.param = param
        self._error = error
        self._dashes = dashes_for_underscores
        self._targets: dict[str, str] = {}
        self._loaded: dict[str, T] = {}
        for entry_id, target in targets.items():
            self[entry_id] = target

    # ---- the mapping of targets ---------------------------------------------------------------------
    def __getitem__(self, entry_id: str) -> str:
        return self._targets[self._key(entry_id)]

    def __setitem__(self, entry_id: str, target: str) -> None:
        assert ":" in target, f"{self.kind} {entry_id!r}: {target!r} is not 'module:attribute'"
        self._targets[entry_id] = target
        self._loaded.pop(entry_id, None)

    def __delitem__(self, entry_id: str) -> None:
        del self._targets[entry_id]
        self._loaded.pop(entry_id, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._targets)

    def __len__(self) -> int:
        return len(self._targets)

    def __contains__(self, entry_id: object) -> bool:
        return isinstance(entry_id, str) and self._key(entry_id) in self._targets

    @property
    def ids(self) -> tuple[str, ...]:
        """The registered ids, in registration order (nothing is imported)."""
        return tuple(self._targets)

    # ---- lookups ----------------------------------------------------------------------------------
    def target(self, entry_id: str) -> str:
        """The "module:attribute" of `entry_id` (imports nothing); the registry's error for an unknown id."""
        target = self._targets.get(self._key(entry_id))
        if target is None:
            raise self._error(f"unknown {self.kind} {entry_id!r} (known: {', '.join(sorted(self._targets))})",
                              self.param)
        return target

    def check(self, entry_id: str) -> None:
        """Raise the registry's error for an unknown id."""
        self.target(entry_id)

    def load(self, entry_id: str) -> T:
        """The attribute `entry_id` names, imported on first use."""
        key = self._key(entry_id)
        loaded = self._loaded.get(key)
        if loaded is None:
            module, _, attr = self.target(entry_id).partition(":")
            loaded = self._loaded[key] = getattr(importlib.import_module(module), attr)
        return loaded

    def create(self, entry_id: str, *args: Any, **kwargs: Any) -> Any:
        """`load(entry_id)(*args, **kwargs)`: an instance of a registered class or a factory's product."""
        factory: Any = self.load(entry_id)
        return factory(*args, **kwargs)

    def _key(self, entry_id: str) -> str:
        return entry_id.replace("_", "-") if self._dashes else entry_id
