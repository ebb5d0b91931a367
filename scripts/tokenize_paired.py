"""Tokenization through two HTTP front ends on the same prompts, paired: `/tokenize` of the `random` workload's own
prompts (random token ids decoded), each prompt to both in alternating order, and the per-prompt difference of the
response times. Made for a gateway with `--tokenize local` against one with `--tokenize service` over the same
tokenizer service (or `serve` against a gateway); prints the medians, p90s and the paired difference, and writes
them as JSON with `--out`. Run it from the repository root (it imports `loadtests`).

    python3 scripts/tokenize_paired.py --a http://127.0.0.1:8001 --b http://127.0.0.1:8002 \\
        [--tokenizer DIR] [--prompts 60] [--tokens 2400] [--out tokenize-paired.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import httpx


def random_texts(tokenizer_dir: str | None, count: int, tokens: int, seed: int) -> list[str]:
    """`count` prompts of the `random` workload (`bench serving --workload random`: `tokens` random ids, decoded)."""
    from loadtests.workloads.random_prompts import RANDOM
    from radixmesh.engine.hf_tokenizer import load_tokenizer
    from radixmesh.engine.loader.default_model import resolve_model_path

    tokenizer = load_tokenizer(tokenizer_dir or str(resolve_model_path(None)[1]))
    lengths = argparse.Namespace(random_input_len=tokens, random_output_len=1, random_range_ratio=1.0)
    workload = RANDOM.build(lengths, tokenizer, count, seed)
    return [str(session.turns[0].prompt) for session in workload.sessions]


def time_tokenize(client: httpx.Client, url: str, text: str) -> float:
    """Milliseconds of one `/tokenize` call (the response read)."""
    start = time.perf_counter()
    response = client.post(f"{url}/tokenize", json={"prompt": text})
    if response.status_code != 200:
        raise SystemExit(f"{url}/tokenize answered {response.status_code}: {response.text[:200]}")
    return (time.perf_counter() - start) * 1e3


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median_ms": round(statistics.median(ordered), 3), "p90_ms": round(ordered[int(0.9 * len(ordered))], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="base URL of the first front end")
    parser.add_argument("--b", required=True, help="base URL of the second front end")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the default model's)")
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=2400, help="random token ids per prompt before decoding")
    parser.add_argument("--warmup", type=int, default=4, help="pairs sent first and not counted")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()
    texts = random_texts(args.tokenizer, args.prompts + args.warmup, args.tokens, args.seed)
    times: dict[str, list[float]] = {"a": [], "b": []}
    with httpx.Client(timeout=120) as client:
        for i, text in enumerate(texts):
            order = ("a", "b") if i % 2 else ("b", "a")  # neither side always goes first
            took = {side: time_tokenize(client, getattr(args, side), text) for side in order}
            if i >= args.warmup:
                for side in ("a", "b"):
                    times[side].append(took[side])
    diffs = [b - a for a, b in zip(times["a"], times["b"])]
    result: dict[str, Any] = {"a": args.a, "b": args.b, "prompts": args.prompts, "tokens": args.tokens,
                              "a_ms": summary(times["a"]), "b_ms": summary(times["b"]),
                              "b_minus_a_median_ms": round(statistics.median(diffs), 3),
                              "b_minus_a_mean_ms": round(statistics.mean(diffs), 3)}
    for side in ("a", "b"):
        print(f"{side} ({getattr(args, side)}): /tokenize median {result[side + '_ms']['median_ms']:.2f} ms, "
              f"p90 {result[side + '_ms']['p90_ms']:.2f} ms over {args.prompts} prompts")
    print(f"paired b - a: median {result['b_minus_a_median_ms']:.2f} ms, mean {result['b_minus_a_mean_ms']:.2f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
