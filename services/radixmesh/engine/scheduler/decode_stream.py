"""Prefills beside the running decode step: decode steps on a CUDA stream of their own, everything else on the
scheduler thread's current stream (`main`).

With one stream, a prompt that arrives while a decode step runs starts its prefill when that step ends: on an
H200 serving the 8B shape at 1 req/s, the device was still busy for a median 3.3 ms when a prefill was launched
(the step trace of 2026-11-29h). Here the prefill is queued on `main` at once and its blocks take the SMs the
running step leaves; the next decode step waits for the prefill anyway (it holds the new request).

Which stream has the device's greatest priority (RADIXMESH_STREAM_PRIORITY) decides what the host sees first. With
`decode` (the default) the running step ends about when it would have, and its results reach the host before the
prefill's. With `main` the prefill runs ahead and the step ends after it: the host, which reads the step's results
before the prefill's, waits for both. Measured on an H200 (8B shape, the text workload, 100 prompts
at 1 req/s through `serve`, per request against one stream on the same machine): `decode` -1.18 ms median TTFT,
`equal` -0.31, `main` -1.02 (another machine); ITL unchanged in all three.

What keeps the two apart:

- every decode launch first waits for all of `main`'s work so far (its slots, rows and inputs were written there);
- a decode step touches only the KV slots and the request rows of its own requests. While it runs, `main` works
  on other requests' slots and rows, until one of the step's requests is released (it finished, was aborted or
  retracted after the step was launched: its slots and row may be handed out again, and the tree gets its row's
  slots, which the step still writes). So every release while a decode step runs makes `main` wait for that step
  first (`KVCacheManager.before_release`), and what `main` does after it is ordered behind the step;
- a prefill that reads tokens the running step samples (`future_rows`) waits for the step;
- a tensor made on `main` that a decode step reads (the previous prefill's sampled tokens) is recorded on
  `decode`, so the caching allocator does not hand its memory to `main` before the step read it; the step's slots,
  also made on `main`, live in its batch until its results are read;
- state a prefill and a decode step could both write: decode graphs own their metadata and scratch; eager decode
  and eager extends keep separate scratch buffers (`AttentionBackend.concurrent_passes`); the sampling-info cache
  keeps decode batches' infos only (made on `decode`).

On CUDA with overlap and decode graphs, for models whose layers keep rows apart (no MoE workspaces), without
LoRA, multimodal inputs, tensor or data parallelism, speculative decoding or the host tier;
`--disable-decode-stream` turns it off.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import TYPE_CHECKING, Any

from radixmesh.common.env import stream_priority
from radixmesh.engine import plain_runner
from radixmesh.engine.scheduler.hooks import SchedulerHook

if TYPE_CHECKING:
    from radixmesh.engine.batch import ScheduleBatch
    from radixmesh.engine.request import Req
    from radixmesh.engine.scheduler.core import Scheduler

logger = logging.getLogger(__name__)


def refusal(sched: Scheduler) -> str | None:
    """Why this scheduler keeps one stream (None: it may run decode steps on their own)."""
    config, runner = sched.config, sched.runner
    if config.disable_decode_stream:
        return "--disable-decode-stream"
    if runner.device.type != "cuda" or not config.overlap_enabled:
        return "no overlap on a CUDA device"
    if not getattr(runner.attn_backend, "concurrent_passes", False):
        return f"the {type(runner.attn_backend).__name__} backend shares state between passes"
    if config.enable_hierarchical_cache:
        return "the host tier"
    return plain_runner.refusal(runner)


def create_hook(sched: Scheduler) -> DecodeStreamHook | None:
    reason = refusal(sched)
    if reason is not None:
        if sched.runner.device.type == "cuda":
            logger.info("decode steps and prefills share one CUDA stream: %s", reason)
        return None
    streams = TorchStreams(sched.runner.device)
    logger.info("decode steps on a CUDA stream of their own (priority %d), prefills on the main stream (priority %d)",
                streams.decode.priority, streams.main.priority)
    return DecodeStreamHook(sched, streams)


class TorchStreams:
    """The two streams and the CUDA calls the hook makes (tests pass a recording stand-in)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.cuda: Any = torch.cuda  # (its stubs call priority_range an instance method; it is static)
        least, greatest = self.cuda.Stream.priority_range()
        first = stream_priority()
        self.main = self.cuda.Stream(device, priority=greatest if first == "main" else least)
        self.decode = self.cuda.Stream(device, priority=greatest if first == "decode" else least)
        self.cuda.synchronize(device)  # (what the build queued on the default stream is done)
        self.cuda.set_stream(self.main)  # this thread's device work from now on

    def enter_decode(self) -> None:
        self.decode.wait_stream(self.main)
        self._scope = self.cuda.stream(self.decode)
        self._scope.__enter__()

    def exit_decode(self) -> Any:
        """Leave the decode stream; an event after the step."""
        self._scope.__exit__(None, None, None)
        end = self.cuda.Event()
        end.record(self.decode)
        return end

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def main_waits(self, event: Any) -> None:
        self.main.wait_event(event)

    def keep_for_decode(self, tensor: Any) -> None:
        tensor.record_stream(self.decode)


class _DecodeScope:
    """`with` around a decode step's launch: on the decode stream, after `main`'s work."""

    def __init__(self, hook: DecodeStreamHook) -> None:
        self.hook = hook

    def __enter__(self) -> None:
        self.hook.enter_decode()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.hook.exit_decode()


class DecodeStreamHook(SchedulerHook):
    """Puts decode launches on the decode stream and decides, per prefill, whether it waits for the running step."""

    def __init__(self, sched: Scheduler, streams: TorchStreams) -> None:
        self.sched = sched
        self.streams = streams
        self.scope = _DecodeScope(self)
        self.step_end: Any = None
        """The event after the last decode step launched (None once it is known to be done)."""
        self.last_on_main = False
        """Whether the runner's last sampled tokens were made on `main` (by a prefill)."""
        self.num_beside = 0
        """Prefills launched while a decode step ran, without waiting for it."""
        self.num_waited = 0
        """Prefills that waited for the running decode step (they read its tokens)."""
        self.num_release_waits = 0
        """Releases of requests that made `main` wait for the running decode step."""
        sched.kv.before_release = self.before_release

    def launch_scope(self, batch: ScheduleBatch) -> _DecodeScope | None:
        if batch.is_decode:
            return self.scope
        self._before_prefill(batch)
        return None  # (on `main`, the thread's stream)

    def enter_decode(self) -> None:
        tokens = self.sched.runner.last_tokens
        if self.last_on_main and tokens is not None:
            self.streams.keep_for_decode(tokens)  # the step reads them (future tokens)
        self.streams.enter_decode()

    def exit_decode(self) -> None:
        self.step_end = self.streams.exit_decode()
        self.last_on_main = False

    def _before_prefill(self, batch: ScheduleBatch) -> None:
        self.last_on_main = True
        if not self._step_running():
            return
        if batch.future_rows:  # (a re-prefill of tokens still on the device)
            self._wait_for_step()
            self.num_waited += 1
        else:
            self.num_beside += 1

    def before_release(self, req: Req) -> None:
        """A request's slots and row are about to be freed or given to the tree: `main` first waits for the step."""
        if self._step_running():
            self._wait_for_step()
            self.num_release_waits += 1

    def _step_running(self) -> bool:
        end = self.step_end
        if end is None:
            return False
        if self.streams.done(end):
            self.step_end = None
            return False
        return True

    def _wait_for_step(self) -> None:
        self.streams.main_waits(self.step_end)
        self.step_end = None  # (everything on `main` from here on is behind it)

    def stats(self) -> dict[str, Any]:
        return {"num_prefills_beside_decode": self.num_beside, "num_prefills_after_decode": self.num_waited,
                "num_releases_after_decode": self.num_release_waits}

