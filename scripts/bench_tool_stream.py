"""Gateway cost of parsing a streamed answer (reasoning, then a tool call with long arguments), per engine
chunk, on the CPU: what a tool-calling request adds to the gateway's event loop per output token.

    PYTHONPATH=services:kernels:. .venv/bin/python scripts/bench_tool_stream.py
"""

from __future__ import annotations

import json
import time

from radixmesh.gateway.reasoning import reasoning_parser
from radixmesh.gateway.tools.output import ChoiceOutput
from radixmesh.gateway.tools.registry import tool_parser


def main() -> None:
    args = json.dumps({"code": "x = [1, {2: 3}]\n" * 250, "n": list(range(200))})
    text = ("<think>\n" + "Let me write it.\n" * 50 + "</think>\n"
            + '<tool_call>\n{"name": "run", "arguments": ' + args + "}\n</tool_call>")
    for piece in (4, 1):
        output = ChoiceOutput(reasoning_parser("qwen3"), tool_parser("hermes"))
        start = time.perf_counter()
        steps = range(0, len(text), piece)
        for i in steps:
            output.feed(text[i:i + piece], final=i + piece >= len(text))
        elapsed = time.perf_counter() - start
        assert output.calls[0].arguments == args
        print(json.dumps({"chars": len(text), "chunk_chars": piece, "chunks": len(steps),
                          "total_ms": round(elapsed * 1e3, 1), "us_per_chunk": round(elapsed / len(steps) * 1e6, 1)}))


if __name__ == "__main__":
    main()
