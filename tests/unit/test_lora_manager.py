"""LoraManager: adapters in host memory (LRU, pinned ones kept) and in device slots (busy slots never
rewritten); and the LoRA options EngineConfig refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.lora.adapter import LoraAdapter
from radixmesh.engine.lora.manager import LoraManager
from radixmesh.engine.lora.options import MAX_LORA_RANK, MAX_LORA_SLOTS, target_modules
from radixmesh.engine.lora.slots import SlotShape
from radixmesh.wire.lora import TARGET_MODULES

from .test_lora_adapter import CONFIG, write_adapter


class FakeSlots:
    def __init__(self, shape: SlotShape) -> None:
        self.shape = shape

    def targets_of(self, adapter: LoraAdapter) -> list[str]:
        return [m for m in adapter.targets if m not in self.shape.targets]


class FakeRuntime:
    """Records slot writes and clears instead of touching device buffers."""

    def __init__(self, num_slots: int, targets: tuple[str, ...] = TARGET_MODULES) -> None:
        self.slots = FakeSlots(SlotShape(num_slots, 64, targets))
        self.writes: list[tuple[int, str]] = []
        self.clears: list[int] = []

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        self.writes.append((slot, adapter.name))

    def clear(self, slot: int) -> None:
        self.clears.append(slot)


def make_manager(tmp_path: Path, num_slots: int = 2, max_loaded: int = 3,
                 targets: tuple[str, ...] = TARGET_MODULES) -> tuple[LoraManager, FakeRuntime, str]:
    runtime = FakeRuntime(num_slots, targets)
    path = str(write_adapter(tmp_path / "adapter", 8))
    return LoraManager(runtime, CONFIG, max_rank=64, max_loaded=max_loaded), runtime, path  # type: ignore[arg-type]


def codes(fn: Any) -> tuple[ErrorCode, str]:
    with pytest.raises(RadixMeshError) as err:
        fn()
    return err.value.code, err.value.message


# ---- host memory ----------------------------------------------------------------------------------------------
def test_load_reports_the_adapter_and_refuses_a_name_twice(tmp_path: Path) -> None:
    mgr, _, path = make_manager(tmp_path)
    info = mgr.load("sql", path)
    assert (info["name"], info["path"], info["rank"], info["targets"]) == ("sql", path, 8, ["q_proj", "v_proj"])
    assert info["load_s"] >= 0 and mgr.has("sql") and not mgr.has("chat")
    code, message = codes(lambda: mgr.load("sql", path))
    assert code is ErrorCode.INVALID_ARGUMENT and "already loaded" in message


def test_adapter_targeting_projections_without_slots_is_refused(tmp_path: Path) -> None:
    mgr, _, path = make_manager(tmp_path, targets=("q_proj", "k_proj"))
    code, message = codes(lambda: mgr.load("sql", path))
    assert code is ErrorCode.INVALID_ARGUMENT and "v_proj" in message and "--lora-target-modules" in message
    assert not mgr.has("sql")


def test_a_bad_adapter_fails_alone(tmp_path: Path) -> None:
    mgr, runtime, path = make_manager(tmp_path)
    mgr.load("good", path)
    code, _ = codes(lambda: mgr.load("bad", str(tmp_path / "nowhere")))
    assert code is ErrorCode.INVALID_ARGUMENT
    assert [a["name"] for a in mgr.info()] == ["good"] and runtime.clears == []


def test_full_host_memory_drops_the_least_recently_used_unpinned(tmp_path: Path) -> None:
    mgr, runtime, path = make_manager(tmp_path, num_slots=2, max_loaded=2)
    mgr.load("a", path)
    mgr.load("b", path)
    assert mgr.slot_for("a", busy=set()) == 0  # a on the device, and now the most recently used
    mgr.load("c", path)  # b is the least recently used: dropped
    assert [x["name"] for x in mgr.info()] == ["c", "a"]
    mgr.load("d", path, pinned={"a"})  # c would be next after a, but a is pinned: c goes
    assert {x["name"] for x in mgr.info()} == {"a", "d"} and runtime.clears == []
    mgr.load("e", path, pinned={"d"})  # a goes and its slot is emptied
    assert {x["name"] for x in mgr.info()} == {"d", "e"} and runtime.clears == [0]
    assert mgr.slot_names[0] is None


def test_full_host_memory_with_every_adapter_in_use_refuses_the_load(tmp_path: Path) -> None:
    mgr, _, path = make_manager(tmp_path, max_loaded=1)
    mgr.load("a", path)
    code, message = codes(lambda: mgr.load("b", path, pinned={"a"}))
    assert code is ErrorCode.INVALID_ARGUMENT and "all in use" in message
    assert mgr.has("a") and not mgr.has("b")


def test_unload_unknown_busy_and_idle(tmp_path: Path) -> None:
    mgr, runtime, path = make_manager(tmp_path)
    assert codes(lambda: mgr.unload("nope", set()))[0] is ErrorCode.NOT_FOUND
    mgr.load("a", path)
    slot = mgr.slot_for("a", busy=set())
    code, message = codes(lambda: mgr.unload("a", {"a"}))
    assert code is ErrorCode.INVALID_ARGUMENT and "in use" in message and mgr.has("a")
    mgr.unload("a", set())
    assert not mgr.has("a") and runtime.clears == [slot] and mgr.slot_names == [None, None]
    mgr.load("a", path)  # the name is free again
    assert mgr.has("a")


# ---- device slots ---------------------------------------------------------------------------------------------
def test_slot_for_reuses_a_held_slot_without_rewriting(tmp_path: Path) -> None:
    mgr, runtime, path = make_manager(tmp_path, num_slots=2)
    mgr.load("a", path)
    first = mgr.slot_for("a", busy=set())
    assert mgr.slot_for("a", busy={first}) == first  # already there: busy does not matter
    assert runtime.writes == [(first, "a")] and mgr.num_slot_loads == 1


def test_slot_for_fills_empty_slots_before_evicting(tmp_path: Path) -> None:
    mgr, runtime, path = make_manager(tmp_path, num_slots=2)
    for name in ("a", "b", "c"):
        mgr.load(name, path)
    assert mgr.slot_for("a", busy=set()) == 0
    assert mgr.slot_for("b", busy=set()) == 1
    mgr.slot_for("a", busy=set())  # a used again: b is now the least recently used slot
    assert mgr.slot_for("c", busy=set()) == 1 and mgr.slot_names == ["a", "c"]
    assert runtime.writes == [(0, "a"), (1, "b"), (1, "c")] and mgr.num_slot_loads == 3
    info = {x["name"]: x["on_device"] for x in mgr.info()}
    assert info == {"a": True, "b": False, "c": True}


def test_slot_for_never_rewrites_a_busy_slot(tmp_path: Path) -> None:
    mgr, runtime, path = make_manager(tmp_path, num_slots=2)
    for name in ("a", "b", "c"):
        mgr.load(name, path)
    mgr.slot_for("a", busy=set())
    mgr.slot_for("b", busy=set())
    assert mgr.slot_for("c", busy={1}) == 0  # a is older, but only slot 0 is free to rewrite anyway
    assert mgr.slot_for("a", busy={0, 1}) is None  # every slot busy: the request waits
    assert mgr.slot_names == ["c", "b"] and runtime.writes[-1] == (0, "c")


def test_info_lists_most_recently_used_first_with_sizes(tmp_path: Path) -> None:
    mgr, _, path = make_manager(tmp_path)
    mgr.load("a", path)
    mgr.load("b", path)
    mgr.slot_for("a", busy=set())
    rows = mgr.info()
    assert [r["name"] for r in rows] == ["a", "b"]
    assert rows[0]["scaling"] == pytest.approx(2.0) and rows[0]["host_bytes"] > 0 and rows[0]["on_device"]


# ---- options --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("settings", "field"), [
    ({"max_lora_rank": 0}, "max_lora_rank"),
    ({"max_lora_rank": MAX_LORA_RANK + 1}, "max_lora_rank"),
    ({"max_loras_per_batch": 0}, "max_loras_per_batch"),
    ({"max_loras_per_batch": MAX_LORA_SLOTS + 1}, "max_loras_per_batch"),
    ({"max_loaded_loras": 0}, "max_loaded_loras"),
    ({"lora_target_modules": ("q_proj", "lm_head")}, "lora_target_modules"),
    ({"lora_paths": ("sql=/a", "/b/sql")}, "lora_paths"),
    ({"lora_paths": ("a=/a", "b=/b"), "max_loaded_loras": 1}, "lora_paths"),
    ({"lora_kernels": "punica"}, "lora_kernels"),
    ({"lora_overlap": "always"}, "lora_overlap"),
])
def test_lora_options_out_of_bounds_are_refused(settings: dict[str, Any], field: str) -> None:
    with pytest.raises(RadixMeshError) as err:
        EngineConfig(load_format="dummy", **settings)
    assert err.value.code is ErrorCode.INVALID_ARGUMENT and err.value.param == field


def test_lora_options_in_bounds_and_their_defaults() -> None:
    config = EngineConfig(load_format="dummy", lora_paths=["sql=/a", "/x/chat"],  # type: ignore[arg-type]
                          lora_target_modules=["q_proj"], max_lora_rank=MAX_LORA_RANK,  # type: ignore[arg-type]
                          max_loras_per_batch=MAX_LORA_SLOTS)
    assert config.lora_paths == ("sql=/a", "/x/chat") and config.lora_enabled  # lists become tuples
    assert target_modules(config) == ("q_proj",)
    plain = EngineConfig(load_format="dummy")
    assert not plain.lora_enabled and target_modules(plain) == TARGET_MODULES
    assert plain.lora_kernels == "auto"
    assert EngineConfig(load_format="dummy", lora_kernels="rows").lora_kernels == "rows"
    assert plain.lora_overlap == "auto"
    assert EngineConfig(load_format="dummy", lora_overlap="off").lora_overlap == "off"


@pytest.mark.parametrize("value", ["auto", "on", "off"])
def test_the_lora_overlap_flag_reaches_the_engine_config(value: str) -> None:
    import argparse

    from radixmesh.engine.args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).lora_overlap == "auto"
    args = parser.parse_args(["--lora-overlap", value])
    kwargs = {**engine_kwargs(args), "load_format": "dummy"}
    assert EngineConfig(**kwargs).lora_overlap == value


def test_the_lora_kernels_flag_offers_every_kernel_set() -> None:
    from radixmesh.engine.lora.options import LORA_KERNELS
    from radixmesh.kernels.lora import KERNELS

    assert sorted(LORA_KERNELS) == sorted(KERNELS)


def test_lora_does_not_combine_with_the_hierarchical_cache() -> None:
    with pytest.raises(RadixMeshError, match="hierarchical cache"):
        EngineConfig(load_format="dummy", enable_lora=True, enable_hierarchical_cache=True)
