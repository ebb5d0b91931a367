"""`radixmesh bench images`: time to first token with one image, and batches of image questions
with one shared image vs distinct images (what the radix cache saves), on a multimodal shape.

Drives the scheduler in-process like `bench one-batch` (random weights of a named shape, token-id
prompts: `--load-format dummy` needs no tokenizer). Images are random noise at `--image-size`,
preprocessed by the model's image processor (timed apart: that runs at the edge). Prints the
device and settings and ends with one JSON line (appended to `--result-file`).
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from radixmesh.engine.bench.throughput import Timeline, _report, _sync_fn, build_scheduler, device_info, settings


@dataclass
class CachedTimeline(Timeline):
    """Timeline that also keeps each request's cached prompt tokens."""

    cached: dict[str, int] = field(default_factory=dict)
    prompt: dict[str, int] = field(default_factory=dict)

    def __call__(self, outputs: list[Any]) -> None:
        super().__call__(outputs)
        for out in outputs:
            self.cached[out.rid], self.prompt[out.rid] = out.cached_tokens, out.prompt_tokens


def _png(seed: int, size: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


class Workload:
    """Token-id prompts `[prefix][image][question]` with their images placed (`MultimodalProcessor`)."""

    def __init__(self, sched: Any, args: argparse.Namespace) -> None:
        from radixmesh.engine.mm.prompt import MultimodalProcessor

        config = sched.runner.model_config
        images = MultimodalProcessor.for_model(config, [sched.config.model], None)  # a directory's processor config
        if images is None:
            raise SystemExit(f"radixmesh: error: {config.architecture} takes no images; use a multimodal shape "
                             "(llava-1.5-7b, qwen2-vl-7b)")
        self.images, self.args = images, args
        self.rng = random.Random(args.seed)
        self.vocab = config.vocab_size
        self.prefix = self._text(args.prefix_len)
        self.preprocess_ms: list[float] = []

    def _text(self, n: int) -> list[int]:
        return [self.rng.randrange(100, min(self.vocab, 32000) - 1) for _ in range(n)]

    def request(self, rid: str, image_seed: int, max_new_tokens: int) -> Any:
        from radixmesh.engine.mm.runtime import ReqImages
        from radixmesh.engine.request import Req
        from radixmesh.wire.images import ImageSource
        from radixmesh.wire.sampling import SamplingParams

        ids = [*self.prefix, self.images.spec.image_token_id, *self._text(self.args.question_len)]
        start = time.perf_counter()
        placed = self.images.prepare_ids(ids, [ImageSource(f"image {image_seed}", data=_png(image_seed,
                                                                                            self.args.image_size))])
        self.preprocess_ms.append(1000 * (time.perf_counter() - start))
        assert placed.mm is not None
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
        return Req(rid=rid, origin_input_ids=placed.input_ids, params=params, mm=ReqImages(placed.mm))


def _run(sched: Any, reqs: list[Any]) -> float:
    sync = _sync_fn(sched)
    sync()
    start = time.perf_counter()
    for req in reqs:
        sched.add_request(req)
    while sched.has_work:
        sched.step()
    sync()
    return start


def _ttft(sched: Any, timeline: CachedTimeline, work: Workload, repeats: int) -> dict[str, Any]:
    """Median TTFT of one request with a new image (nothing cached), then with the same image again."""
    new, again = [], []
    for i in range(repeats):
        req = work.request(f"ttft{i}", 1000 + i, 1)
        start = _run(sched, [req])
        new.append(1000 * (timeline.first_token_s[req.rid] - start))
        req2 = work.request(f"ttft{i}b", 1000 + i, 1)
        req2.origin_input_ids = req.origin_input_ids  # the same question too: everything but one token cached
        start = _run(sched, [req2])
        again.append(1000 * (timeline.first_token_s[req2.rid] - start))
    return {"ttft_ms_median": round(statistics.median(new), 2), "ttft_ms_min": round(min(new), 2),
            "ttft_cached_image_ms_median": round(statistics.median(again), 2),
            "prompt_tokens": timeline.prompt[f"ttft{repeats - 1}"]}


def _batch(sched: Any, timeline: CachedTimeline, work: Workload, shared: bool) -> dict[str, Any]:
    """A batch of questions about one shared image or one image each; cache flushed before."""
    args = work.args
    assert sched.flush_cache(), "the cache could not be flushed (requests still running)"
    sched.runner.mm.cache.clear()
    encoded_before = sched.runner.mm.num_images_encoded
    reqs = [work.request(f"{'s' if shared else 'd'}{i}", 7 if shared else 2000 + i, args.output_len)
            for i in range(args.batch_size)]
    timeline.reset()
    start = _run(sched, reqs)
    elapsed = max(timeline.done_s.values()) - start
    prompt = sum(timeline.prompt[r.rid] for r in reqs)
    cached = sum(timeline.cached[r.rid] for r in reqs)
    ttfts = [1000 * (timeline.first_token_s[r.rid] - start) for r in reqs]
    return {"seconds": round(elapsed, 3), "requests_per_s": round(len(reqs) / elapsed, 3),
            "output_tokens_per_s": round(sum(timeline.num_tokens.values()) / elapsed, 1),
            "ttft_ms_median": round(statistics.median(ttfts), 2), "prompt_tokens": prompt,
            "cached_tokens": cached, "cache_hit_rate": round(cached / prompt, 4),
            "images_encoded": sched.runner.mm.num_images_encoded - encoded_before}


def cmd_images(args: argparse.Namespace) -> int:
    if args.model_shape is None and args.model is None:
        args.model_shape = "llava-1.5-7b"
    timeline = CachedTimeline()
    sched = build_scheduler(args, timeline)
    work = Workload(sched, args)
    _run(sched, [work.request("warm0", 1, 4), work.request("warm1", 2, 4)])  # compile kernels, settle memory
    work.preprocess_ms.clear()
    ttft = _ttft(sched, timeline, work, args.repeats)
    preprocess = statistics.median(work.preprocess_ms)
    shared, distinct = _batch(sched, timeline, work, True), _batch(sched, timeline, work, False)
    result = {"bench": "images", **device_info(sched), **settings(sched, args), "image_size": args.image_size,
              "image_tokens": ttft["prompt_tokens"] - args.prefix_len - args.question_len,
              "preprocess_ms_median": round(preprocess, 2), **{f"one_image_{k}": v for k, v in ttft.items()},
              "batch_size": args.batch_size, "output_len": args.output_len,
              **{f"shared_{k}": v for k, v in shared.items()}, **{f"distinct_{k}": v for k, v in distinct.items()},
              "shared_vs_distinct_throughput": round(shared["requests_per_s"] / distinct["requests_per_s"], 3)}
    _report(result, args)
    return 0


def register_images(bench: argparse._SubParsersAction) -> None:
    from radixmesh.engine.bench.throughput import _common

    parser = bench.add_parser("images", help="multimodal: TTFT with one image; shared vs distinct images in a batch")
    _common(parser)
    parser.set_defaults(func=cmd_images)
    parser.add_argument("--image-size", type=int, default=336, help="side of the square test images, in pixels")
    parser.add_argument("--prefix-len", type=int, default=32, help="text tokens before the image")
    parser.add_argument("--question-len", type=int, default=16, help="text tokens after the image")
    parser.add_argument("--repeats", type=int, default=5, help="single-request TTFT measurements")
    parser.add_argument("--batch-size", type=int, default=32, help="requests of the shared / distinct batches")
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated per batch request")
    parser.add_argument("--seed", type=int, default=1)
