"""The chart's speculative-decoding values: rendered as the engine's flags, checked by the values schema."""

from __future__ import annotations

import pytest

from .chart import component_of, container, flag, of_kind, render, run_helm, template_args

pytestmark = pytest.mark.helm


def test_speculative_values_render_as_engine_flags_the_worker_parses(helm: str) -> None:
    from radixmesh.cli import build_parser
    from radixmesh.engine.args import engine_kwargs

    docs = render(helm, sets=["worker.engine.speculativeAlgorithm=draft", "worker.engine.speculativeNumDraftTokens=6",
                              "worker.engine.speculativeDraftModel=/models/draft"])
    worker = next(d for d in of_kind(docs, "Deployment").values() if component_of(d) == "worker")
    args = container(worker)["args"]
    assert flag(args, "speculative-algorithm") == "draft"
    assert flag(args, "speculative-num-draft-tokens") == "6"
    assert flag(args, "speculative-draft-model") == "/models/draft"
    parsed = engine_kwargs(build_parser().parse_args(args))
    assert (parsed["speculative_algorithm"], parsed["speculative_num_draft_tokens"],
            parsed["speculative_draft_model"]) == ("draft", 6, "/models/draft")

    plain = render(helm)
    worker = next(d for d in of_kind(plain, "Deployment").values() if component_of(d) == "worker")
    assert not [a for a in container(worker)["args"] if "speculative" in a]  # null: off, no flag


@pytest.mark.parametrize("sets, message", [
    (["worker.engine.speculativeAlgorithm=medusa"], "/worker/engine/speculativeAlgorithm"),
    (["worker.engine.speculativeNumDraftTokens=0"], "/worker/engine/speculativeNumDraftTokens"),
    (["worker.engine.speculativeNumDraftTokens=17"], "/worker/engine/speculativeNumDraftTokens"),
])
def test_bad_speculative_values_are_refused(helm: str, sets: list[str], message: str) -> None:
    result = run_helm(helm, *template_args(sets=sets))
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
