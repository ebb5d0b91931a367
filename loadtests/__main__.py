"""`python -m loadtests SUBCOMMAND ...`, the same as `radixmesh bench SUBCOMMAND ...`."""

from __future__ import annotations

import argparse
import sys

from loadtests.commands import add_bench_commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests", description="radixmesh benchmarks")
    add_bench_commands(parser)
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
