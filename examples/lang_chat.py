"""A multi-turn chat as a program: each turn's prompt is the whole conversation so far,
which the server's prefix cache already holds, so every turn only computes its new text.
The program's text is streamed as it is written.

    radixmesh serve &
    python examples/lang_chat.py [--url URL] [--api-key KEY] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import os
import sys

from radixmesh.lang import RuntimeEndpoint, assistant, function, gen, system, user

QUESTIONS = [
    "What is the capital of France?",
    "What is a famous building there?",
    "How tall is it, roughly?",
]


@function
def chat(s, questions: list[str], reply_tokens: int = 48):
    s += system("You are a helpful assistant. Keep answers short.")
    for i, question in enumerate(questions):
        s += user(question)
        s += assistant(gen(f"answer_{i}", max_tokens=reply_tokens))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a radixmesh server")
    parser.add_argument("--api-key", default=os.environ.get("RADIXMESH_API_KEY"))
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per reply")
    args = parser.parse_args(argv)
    with RuntimeEndpoint(args.url, api_key=args.api_key) as backend:
        # The program's text as it is written: template markup, questions and the model's replies.
        state = chat.run(questions=QUESTIONS, reply_tokens=args.max_tokens, backend=backend, temperature=0,
                         stream=True)
        for chunk in state:
            print(chunk, end="", flush=True)
        print("\n--- the conversation as messages ---")
        for message in state.messages():
            print(f"{message['role']}: {message['content']}")
        cached = [state.get_meta_info(f"answer_{i}")["cached_tokens"] for i in range(len(QUESTIONS))]
        print(f"prompt tokens served from the prefix cache, per turn: {cached}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
