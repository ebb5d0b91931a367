"""The benchmarks' host-phase timers (`HostPhases`) and kernel grouping, without a device."""

from __future__ import annotations

import time

from radixmesh.engine.bench_profile import HostPhases, _prefill_host_ms, kernel_kind


class Part:
    def work(self) -> str:
        time.sleep(0.002)
        return "done"


class Sched:
    def __init__(self) -> None:
        self.runner = Part()

    def outer(self) -> str:
        return self.inner() + self.runner.work()

    def inner(self) -> str:
        time.sleep(0.001)
        return "in-"


def test_phases_time_nested_methods_start_again_and_come_off() -> None:
    sched = Sched()
    phases = HostPhases(sched, {"sched": ("outer", "inner"), "runner": ("work",)})
    assert sched.outer() == "in-done"  # the timers pass results through
    first = phases.take()
    assert set(first) == {"outer", "inner", "work"}
    assert first["outer"] >= first["inner"] + first["work"] >= 0.003  # a nested call counts in each
    assert phases.take() == {}
    phases.detach()
    assert "outer" not in vars(sched) and "work" not in vars(sched.runner)
    sched.outer()
    assert phases.take() == {}, "a detached timer still counted"


def test_prefill_host_split_takes_the_wait_out_of_the_results() -> None:
    runs = [{"get_next_batch": 0.001, "launch": 0.02, "process_batch_result": 0.05, "_wait_for_results": 0.048},
            {"get_next_batch": 0.003, "launch": 0.03, "process_batch_result": 0.07, "_wait_for_results": 0.069}]
    got = _prefill_host_ms(runs)
    assert got.keys() == {"schedule", "launch", "results", "wait_for_device"}
    assert (got["schedule"], got["launch"], got["wait_for_device"]) == (2.0, 25.0, 58.5)
    assert abs(got["results"] - 1.5) < 1e-6
    assert _prefill_host_ms([]) == {}


def test_kernel_kinds() -> None:
    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "extend-attention"
    assert kernel_kind("_extend_kernel") == "extend-attention"
    assert kernel_kind("nvjet_sm90_tst_256x128_64x4") == "gemm"
    assert kernel_kind("_decode_split_kernel") == "decode-attention"
