"""`radixmesh bench faults --short` on the cheapest scenarios: a real cluster (2 workers, Redis, the default
model on CPU), one fault at a time under streaming load. Nothing may hang, no KV slot may stay in use, and
requests that had no token when a worker died or its link was cut are re-routed (none fails). Through a
worker's death (kill -9) and a rolling restart no request fails at all: streams under way move to the other
worker, and no token is lost, repeated or changed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCENARIOS = ("client-disconnect", "proxy-cut", "worker-kill", "rolling-restart")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    output = tmp_path_factory.mktemp("faults") / "faults.json"
    cmd = [sys.executable, "-m", "radixmesh.cli", "bench", "faults", "--short",
           "--scenarios", ",".join(SCENARIOS), "--output-file", str(output)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, check=False)
    assert output.is_file(), f"bench faults wrote no results ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(Path(output).read_text())
    return {run["scenario"]: run for run in result["runs"]}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_nothing_hangs_and_no_slot_leaks(runs: dict[str, dict[str, Any]], scenario: str) -> None:
    run = runs[scenario]
    assert run["sent"] > 0
    assert run["hung"] == 0, run["errors"]
    assert run["leaked_slots"] == 0, (run["kv_idle"], run["kv_settled"])
    assert run["sent"] == run["completed"] + run["failed_clear"] + run["aborted"]


@pytest.mark.parametrize("scenario", ["proxy-cut", "worker-kill"])
def test_requests_without_a_token_are_rerouted_and_the_fault_is_seen(runs: dict[str, dict[str, Any]],
                                                                      scenario: str) -> None:
    run = runs[scenario]
    assert run["failed_not_started"] == 0, run["errors"]
    assert run["detect_s"] is not None and run["detect_s"] < 5.0
    assert run["completed"] > run["failed_clear"]


def test_clients_that_go_away_free_their_slots(runs: dict[str, dict[str, Any]]) -> None:
    run = runs["client-disconnect"]
    assert run["aborted"] == 50
    assert sum(run["kv_settled"].values()) == sum(run["kv_idle"].values())


@pytest.mark.parametrize("scenario", ["worker-kill", "rolling-restart"])
def test_no_request_fails_and_no_token_is_lost_repeated_or_changed(runs: dict[str, dict[str, Any]],
                                                                   scenario: str) -> None:
    run = runs[scenario]
    assert run["failed_clear"] == 0 and run["hung"] == 0, run["errors"]
    assert (run["tokens_lost"], run["tokens_duplicated"], run["usage_mismatches"]) == (0, 0, 0)
    assert run["compared"] > 0 and run["text_mismatches"] == 0
    assert run["migration"]["affected_streams"] > 0, "no stream was under way at the fault"


def test_a_killed_worker_s_streams_were_migrated(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["worker-kill"]["migration"]["router_migrations"].get("worker-lost", 0) > 0
