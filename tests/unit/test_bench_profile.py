"""The benchmarks' host-phase timers (`HostPhases`) and kernel grouping, without a device."""

from __future__ import annotations

import time

from radixmesh.engine.bench.profile import HostPhases, _gaps, _prefill_host_ms, kernel_kind


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
    runs = [{"schedule": 0.001, "launch": 0.02, "process": 0.05, "_wait_for_results": 0.048},
            {"schedule": 0.003, "launch": 0.03, "process": 0.07, "_wait_for_results": 0.069}]
    got = _prefill_host_ms(runs)
    assert got.keys() == {"schedule", "launch", "results", "wait_for_device"}
    assert (got["schedule"], got["launch"], got["wait_for_device"]) == (2.0, 25.0, 58.5)
    assert abs(got["results"] - 1.5) < 1e-6
    assert _prefill_host_ms([]) == {}


def test_kernel_kinds() -> None:
    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "extend-attention"
    assert kernel_kind("_extend_kernel") == "extend-attention"
    assert kernel_kind("_moe_gemm_kernel") == kernel_kind("_route_kernel") == kernel_kind("_combine_kernel") == "moe"
    assert kernel_kind("nvjet_sm90_tst_256x128_64x4") == "gemm"
    assert kernel_kind("_decode_split_kernel") == "decode-attention"


def test_gaps_merge_overlapping_kernels_and_count_long_waits() -> None:
    import types

    import torch

    def kernel(start: float, end: float, device: object = torch.autograd.DeviceType.CUDA) -> object:
        return types.SimpleNamespace(device_type=device, time_range=types.SimpleNamespace(start=start, end=end))

    events = [kernel(0, 100), kernel(50, 120), kernel(130, 200),  # 10 us apart: not a wait
              kernel(400, 500), kernel(0, 5000, torch.autograd.DeviceType.CPU), kernel(1500, 1600)]
    got = _gaps(events, torch)
    assert got["device_busy_ms"] == 0.39  # 0-120, 130-200, 400-500, 1500-1600 (us)
    assert got["device_span_ms"] == 1.6
    assert got["device_gaps"] == {"count": 2, "total_ms": 1.2, "max_ms": 1.0}
    assert _gaps([kernel(0, 5000, torch.autograd.DeviceType.CPU)], torch) == {}


def test_device_split_finds_where_the_device_waited_for_the_host() -> None:
    from radixmesh.engine.bench.profile import OfflineProfiler, _Launch

    class Event:
        def __init__(self, ms: float) -> None:
            self.ms = ms

        def elapsed_time(self, other: Event) -> float:
            return other.ms - self.ms

    prof = OfflineProfiler.__new__(OfflineProfiler)  # no scheduler to wrap: the timed launches are given
    # an extend 0-30 ms, decodes at 30-40 (busy), 52-60 (12 ms wait), 60.6-70.6 (0.6 ms wait)
    spans = [(False, 0, 30), (True, 30, 40), (True, 52, 60), (True, 60.6, 70.6)]
    prof.launches = [_Launch(is_decode, 4 if is_decode else 100, 4 if is_decode else 1, 400, Event(a), Event(b))
                     for is_decode, a, b in spans]
    prof.profiler_edges = set()
    decode = [x for x in prof.launches if x.is_decode]
    extend = [x for x in prof.launches if not x.is_decode]
    got = prof._device_split(decode, extend, wall_s=0.0706, kv_bytes_per_token=1000)
    assert got["decode_device_s"] == 0.028 and got["extend_device_s"] == 0.03
    assert got["device_idle_s"] == 0.013
    assert got["idle_before_launch_s"] == {"decode": 0.013, "extend": 0.0, "profiler": 0.0}
    assert got["idle_gaps_over_1ms"] == {"count": 1, "total_s": 0.012}
    assert got["longest_idle_gaps"][0] == {"launch": 2, "ms": 12.0, "decode": True, "after_decode": True,
                                           "batch": 4}
    assert got["idle_before_launch_by_tenth_s"] == [0.0, 0.0, 0.012, 0.001]
    prof.profiler_edges = {2}  # a traced window closed (a sync) before launch 2: that wait is the profiler's
    got = prof._device_split(decode, extend, wall_s=0.0706, kv_bytes_per_token=1000)
    assert got["idle_before_launch_s"] == {"decode": 0.001, "extend": 0.0, "profiler": 0.012}
    assert got["idle_gaps_over_1ms"] == {"count": 0, "total_s": 0.0}
    assert got["longest_idle_gaps"][0]["launch"] == 3
