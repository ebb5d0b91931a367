"""How much a prompt's tokenization depends on what the CPU did just before: the Rust tokenizer encoding fresh
prompts of the `random` workload (each text once) right after the previous encode, after a pause (sleeping, or
spinning the CPU without touching the tokenizer), and after a pause followed by a warm-up encode of another prompt.
One thread, no pool, no server: `encode_batch_fast` of one text, as `TokenizerPool` calls it. The conditions take
turns prompt by prompt, so drift in the machine's speed falls on all alike. Prints the median milliseconds per
condition and writes them as JSON with `--out`. Run it from the repository root (it imports `loadtests`).

    python3 scripts/tokenize_warmth.py [--tokenizer DIR] [--tokens 1000] [--rounds 80] [--pause-ms 20] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenize_paired import random_texts, summary


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(encode: Callable[[str], Any], texts: list[str], rounds: int, pause_s: float) -> dict[str, list[float]]:
    """Milliseconds of each condition's encodes; every encode (warm-ups too) gets a text not encoded before."""
    fresh = iter(texts)
    conditions: dict[str, Callable[[], None]] = {
        "back-to-back": lambda: None,
        "after-sleep": lambda: time.sleep(pause_s),
        "after-spin": lambda: spin(pause_s),
        "after-sleep-then-warm-up": lambda: (time.sleep(pause_s), encode(next(fresh))),
    }
    times: dict[str, list[float]] = {name: [] for name in conditions}
    encode(next(fresh))
    for _ in range(rounds):
        for name, before in conditions.items():
            before()
            text = next(fresh)
            start = time.perf_counter()
            encode(text)
            times[name].append((time.perf_counter() - start) * 1e3)
            if name != "back-to-back":
                encode(next(fresh))  # the next condition's "previous encode"
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the default model's)")
    parser.add_argument("--tokens", type=int, default=1000, help="prompt length in random token ids")
    parser.add_argument("--rounds", type=int, default=80, help="prompts per condition")
    parser.add_argument("--pause-ms", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    from radixmesh.engine.hf_tokenizer import load_tokenizer
    from radixmesh.engine.loader.default_model import resolve_model_path

    tokenizer_dir = args.tokenizer or str(resolve_model_path(None)[1])
    backend = load_tokenizer(tokenizer_dir)._tokenizer
    encode_fast = getattr(backend, "encode_batch_fast", backend.encode_batch)
    texts = random_texts(tokenizer_dir, 8 * args.rounds + 1, args.tokens, args.seed)
    times = measure(lambda text: encode_fast([text], add_special_tokens=True), texts, args.rounds,
                    args.pause_ms / 1e3)
    result = {"tokens": args.tokens, "rounds": args.rounds, "pause_ms": args.pause_ms,
              "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "conditions": {name: summary(v) for name, v in times.items()}}
    for name, figures in result["conditions"].items():
        print(f"{name:>26}: median {figures['median_ms']:.2f} ms, p90 {figures['p90_ms']:.2f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))

if __name__ == "__main__":
    main()
