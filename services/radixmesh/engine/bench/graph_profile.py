"""Kernel listings for `radixmesh bench one-batch --profile-graph` (torch.profiler, CUDA).

One decode graph replay alone, or whole decode steps (the replay plus input staging,
sampling and copies): how many kernels run and where the device time goes.
"""

from __future__ import annotations

from typing import Any


def profile_decode_steps(sched: Any, reqs: list[Any], skip: int = 4, steps: int = 16,
                         top: int = 25) -> dict[str, Any]:
    """Device work of whole decode steps (graph replay plus everything around it: input staging,
    sampling, copies), listed per step: what a step costs beyond the captured forward (the `top` kernels by
    device time)."""
    import torch

    for req in reqs:
        sched.add_request(req)
    for _ in range(skip):  # prefill and the first decode steps
        sched.step()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                sched.step()
            torch.cuda.synchronize()
        summary = _kernel_summary(prof.key_averages(), runs=steps, top=top)
    except Exception as exc:
        summary = {"graph_profile_error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    while sched.has_work:
        sched.step()
    return {key.replace("graph_", "step_"): value for key, value in summary.items()}


def profile_graph(graphs: Any, batch_size: int, seq_len: int, iters: int = 10) -> dict[str, Any]:
    """Kernels of one decode graph replay (torch.profiler): how many, and where the device time goes."""
    import torch

    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            graphs.time_replay_ms(batch_size, seq_len, iters)
        return _kernel_summary(prof.key_averages(), runs=iters + 1)  # time_replay_ms replays once more first
    except Exception as exc:  # a profiler that cannot trace must not lose the other figures
        return {"graph_profile_error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def _kernel_summary(events: Any, runs: int, top: int = 15) -> dict[str, Any]:
    import torch

    def device_us(event: Any) -> float:
        return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))

    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA), key=device_us,
                     reverse=True)
    rows = [{"kernel": e.key[:90], "calls_per_replay": round(e.count / runs, 2),
            "us_per_replay": round(device_us(e) / runs, 1)} for e in kernels[:top]]
    for row in rows:
        print(f"  {row['us_per_replay']:>9.1f} us  {row['calls_per_replay']:>7.1f} x  {row['kernel']}")
    return {"graph_kernels_per_replay": round(sum(e.count for e in kernels) / runs, 1),
            "graph_kernel_us_per_replay": round(sum(device_us(e) for e in kernels) / runs, 1),
            "graph_top_kernels": rows}
