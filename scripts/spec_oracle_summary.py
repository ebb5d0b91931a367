"""Summarise the `spec-oracle` stage (issue 47): each measured speed-up against its target.

    python3 scripts/spec_oracle_summary.py out/spec-oracle.jsonl

Rows come from `radixmesh bench speculative` (8B shape, random weights): oracle drafts at the 1B shape's cost
(acceptance 1.0 and 0.7, batch 1 and 8), and a draft model with the target's own weights (batch 1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TARGETS = [
    ("oracle at the 1B shape's cost, acceptance 1.0, batch 1", "oracle", 1.0, 1, 2.3),
    ("draft = the target's own weights, batch 1", "draft", None, 1, 0.7),
    ("oracle at the 1B shape's cost, acceptance 0.7, batch 1", "oracle", 0.7, 1, 1.5),
    ("oracle at the 1B shape's cost, acceptance 0.7, batch 8", "oracle", 0.7, 8, 1.2),
]


def _find(rows: list[dict[str, Any]], algorithm: str, acceptance: float | None, batch: int) -> dict[str, Any] | None:
    for row in rows:
        if (row.get("speculative_algorithm") == algorithm and row.get("batch_size") == batch
                and row.get("oracle_acceptance") == acceptance):
            return row
    return None


def main(paths: list[str]) -> int:
    rows = [json.loads(line) for path in paths for line in Path(path).read_text().splitlines() if line.strip()]
    print(f"{'target':<58}{'speedup':>9}{'needs':>7}{'accept':>8}{'len':>6}{'same':>8}{'diverged':>9}  verdict")
    for name, algorithm, acceptance, batch, need in TARGETS:
        row = _find(rows, algorithm, acceptance, batch)
        if row is None:
            print(f"{name:<58}{'-':>9}{need:>7.2f}  not measured")
            continue
        verdict = "MET" if row["speedup"] >= need else "MISSED"
        print(f"{name:<58}{row['speedup']:>9.3f}{need:>7.2f}{row['accept_rate']:>8.3f}{row['mean_accept_length']:>6.2f}"
              f"{row['identical_outputs']:>8}{row.get('oracle_diverged', '-'):>9}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
