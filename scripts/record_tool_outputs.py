"""Record what the default model writes when offered tools in each parser's syntax, unconstrained: the raw
texts behind tests/unit/tool_outputs.py's SMOLLM2_OUTPUTS. The prompt is the one the gateway writes for a
chat template without tools (radixmesh.gateway.tools.prompt.as_text), sent as token ids to a running server's
/v1/completions so that nothing parses the answer.

    radixmesh serve --port 8000 &
    PYTHONPATH=services:kernels:. .venv/bin/python scripts/record_tool_outputs.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from loadtests.tool_calls import TOOLS
from radixmesh.engine.hf_tokenizer import encode_chat, load_tokenizer
from radixmesh.engine.loader.default_model import ensure_default_model
from radixmesh.gateway.tools.base import ToolSpec
from radixmesh.gateway.tools.prompt import as_text
from radixmesh.gateway.tools.registry import TOOL_PARSERS, tool_parser

QUESTIONS = ["What is the weather like in Kyoto right now?", "Order two mugs for Ana in Lima, express please.",
             "Tell me a short joke."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--seeds", type=int, default=2, help="samples per parser and question (n)")
    parser.add_argument("--parsers", nargs="+", default=sorted(TOOL_PARSERS))
    parser.add_argument("--questions", nargs="+", default=QUESTIONS)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    tokenizer = load_tokenizer(ensure_default_model())
    tools = [ToolSpec(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
             for t in TOOLS]
    asks = [(parser_id, question) for parser_id in args.parsers for question in args.questions]

    def record(ask: tuple[str, str]) -> list[str]:
        parser_id, question = ask
        messages = as_text([{"role": "user", "content": question}], tools, tool_parser(parser_id))
        body = {"prompt": encode_chat(tokenizer, messages), "max_tokens": args.max_tokens, "temperature": 1.0,
                "seed": 0, "n": args.seeds, "skip_special_tokens": not tool_parser(parser_id).keeps_special_tokens}
        choices = httpx.post(f"{args.url}/v1/completions", json=body, timeout=3600).json()["choices"]
        return [json.dumps({"parser": parser_id, "question": question, "sample": i,
                            "finish_reason": c["finish_reason"], "text": c["text"]}) for i, c in enumerate(choices)]

    with ThreadPoolExecutor(len(asks)) as pool:  # all in flight at once: the engine batches them
        for lines in pool.map(record, asks):
            print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
