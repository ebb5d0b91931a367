"""Judge an essay along several dimensions at once, then summarize and grade it.

The judgments run as parallel branches of one program (`fork`): they share the system
prompt and the essay, which the server computes once and then serves from its prefix
cache. The grade is a `select`: the letter the model finds most likely, scored from
prompt log-probabilities rather than sampled.

    radixmesh serve &                       # http://127.0.0.1:8000, the default model
    python examples/lang_essay_judge.py [--url URL] [--api-key KEY] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import os
import sys

from radixmesh.lang import RuntimeEndpoint, assistant, function, gen, select, system, user

DIMENSIONS = ["Clarity", "Argument", "Grammar"]
GRADES = ["A", "B", "C", "D"]
ESSAY = (
    "Cities should plant more trees. Trees cool the streets in summer, clean the air and give birds a home. "
    "Some people say trees cost too much to care for, but the savings on air conditioning and health care "
    "are bigger than the cost. Every new street should have trees on both sides."
)


@function
def judge_essay(s, essay: str, judgment_tokens: int = 48):
    s += system("You are an experienced writing teacher who grades short essays.")
    s += user(f"Here is a student's essay:\n\n{essay}")
    branches = s.fork(len(DIMENSIONS))
    for branch, dimension in zip(branches, DIMENSIONS):
        branch += user(f"Comment on the {dimension.lower()} of this essay in one sentence.")
        branch += assistant(gen("judgment", max_tokens=judgment_tokens, stop="\n\n"))
    branches.join()  # s["judgment"] is now the list of the branches' judgments
    notes = "\n".join(f"{dimension}: {text.strip()}" for dimension, text in zip(DIMENSIONS, s["judgment"]))
    s += user(f"Your notes on the essay:\n{notes}\n\nSummarize them in one sentence.")
    s += assistant(gen("summary", max_tokens=judgment_tokens, stop="\n"))
    s += user(f"Give the essay a letter grade ({', '.join(GRADES)}).")
    s += assistant("Grade: " + select("grade", choices=GRADES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a radixmesh server")
    parser.add_argument("--api-key", default=os.environ.get("RADIXMESH_API_KEY"))
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per judgment and for the summary")
    args = parser.parse_args(argv)
    with RuntimeEndpoint(args.url, api_key=args.api_key) as backend:
        state = judge_essay.run(essay=ESSAY, judgment_tokens=args.max_tokens, backend=backend, temperature=0)
        for dimension, judgment in zip(DIMENSIONS, state["judgment"]):
            print(f"{dimension}: {judgment.strip()}")
        print(f"Summary: {state['summary'].strip()}")
        print(f"Grade: {state['grade']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
