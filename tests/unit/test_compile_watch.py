"""The compile watch: start-up compiles are counted quietly, later ones are warnings naming the kernel."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from radixmesh.engine import compile_watch
from radixmesh.engine.compile_watch import CompileWatch, install_from_env


def test_compiles_after_ready_are_warnings_with_their_time(caplog: pytest.LogCaptureFixture) -> None:
    watch = CompileWatch()
    assert watch.before(key="k1") is False  # never skips the compile
    watch.after(key="k1", fn=SimpleNamespace(name="_a"), compile={"constants": {(3,): 64}})
    watch.mark_ready()
    with caplog.at_level(logging.WARNING, logger=compile_watch.__name__):
        watch.before(key="k2")
        watch.after(key="k2", fn=SimpleNamespace(name="_b"), compile={"constants": {(5,): 128}, "configs": [{}]})
    assert [name for name, _ in watch.startup] == ["_a"]
    assert [name for name, _ in watch.serving] == ["_b"]
    assert watch.serving[0][1] >= 0.0
    assert "compiled while serving" in caplog.text and "_b constants {(5,): 128}" in caplog.text


def test_installed_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton import knobs

    monkeypatch.delenv(compile_watch.ENV, raising=False)
    assert install_from_env() is None
    monkeypatch.setenv(compile_watch.ENV, "1")
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    watch = install_from_env()
    assert watch is not None
    assert knobs.runtime.jit_cache_hook == watch.before and knobs.runtime.jit_post_compile_hook == watch.after
