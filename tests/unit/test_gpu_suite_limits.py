"""scripts/gpu_suite.sh's per-stage time limits: the online stage's default follows its workloads."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[2] / "scripts" / "gpu_suite.sh"


def stage_limit(stage: str, **env: str) -> int:
    """The limit gpu_suite.sh gives `stage` under `env` (its STAGE_TIMEOUT_S line and stage_limit function alone)."""
    script = f"source <(sed -n '/^STAGE_TIMEOUT_S=/,/^}}/p' {SUITE}); stage_limit {stage}"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TIMEOUT_", "ONLINE_", "STAGE_TIMEOUT"))}
    out = subprocess.run(["bash", "-c", script], env={**clean, **env}, capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.parametrize(("env", "expected"), [
    ({}, 90 + 2 * 160),  # random and random-ids, 100 prompts each at 1 req/s
    ({"ONLINE_WORKLOADS": "random"}, 90 + 160),
    ({"ONLINE_WORKLOAD": "random", "ONLINE_WORKLOADS": "a b c"}, 90 + 160),  # ONLINE_WORKLOAD alone wins
    ({"ONLINE_WORKLOADS": "random random-text-ids random-ids", "ONLINE_PROMPTS": "80"}, 90 + 3 * 140),
    ({"ONLINE_PROMPTS": "100", "ONLINE_RATE": "4"}, 90 + 2 * 85),
    ({"TIMEOUT_online": "330"}, 330),
])
def test_the_online_stage_gets_time_for_each_workload(env: dict[str, str], expected: int) -> None:
    assert stage_limit("online", **env) == expected


def test_other_stages_keep_their_own_limit_or_the_suite_default() -> None:
    assert stage_limit("pd-goodput") == 240
    assert stage_limit("pd-goodput", STAGE_TIMEOUT_S="600") == 600
    assert stage_limit("pd-goodput", TIMEOUT_pd_goodput="500") == 500
