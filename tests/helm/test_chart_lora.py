"""The chart's LoRA values: rendered as the worker's flags (parsed by the worker's own parser), the adapters'
volume mounted read-only, bad values refused by the schema."""

from __future__ import annotations

import pytest

from .chart import component_of, container, of_kind, render, run_helm, template_args

pytestmark = pytest.mark.helm


def test_lora_values_render_as_flags_the_worker_parses(helm: str) -> None:
    from radixmesh.cli import build_parser
    from radixmesh.engine.args import engine_kwargs

    docs = render(helm, sets=["worker.lora.enabled=true", "worker.lora.adapters.sql=/adapters/sql",
                              "worker.lora.adapters.chat=/adapters/chat", "worker.lora.maxLorasPerBatch=4",
                              "worker.lora.volume.persistentVolumeClaim.claimName=adapters"])
    worker = next(d for d in of_kind(docs, "Deployment").values() if component_of(d) == "worker")
    parsed = engine_kwargs(build_parser().parse_args(container(worker)["args"]))
    assert parsed["enable_lora"] and parsed["max_loras_per_batch"] == 4 and parsed["max_lora_rank"] == 64
    assert sorted(parsed["lora_paths"]) == ["chat=/adapters/chat", "sql=/adapters/sql"]
    mount = next(m for m in container(worker)["volumeMounts"] if m["name"] == "lora-adapters")
    assert mount == {"name": "lora-adapters", "mountPath": "/adapters", "readOnly": True}
    volume = next(v for v in worker["spec"]["template"]["spec"]["volumes"] if v["name"] == "lora-adapters")
    assert volume["persistentVolumeClaim"] == {"claimName": "adapters"}

    plain = render(helm)
    worker = next(d for d in of_kind(plain, "Deployment").values() if component_of(d) == "worker")
    assert not [a for a in container(worker)["args"] if "lora" in a]


@pytest.mark.parametrize("sets, message", [
    (["worker.lora.maxLoraRank=512"], "/worker/lora/maxLoraRank"),
    (["worker.lora.maxLorasPerBatch=0"], "/worker/lora/maxLorasPerBatch"),
    (["worker.lora.bogus=1"], "bogus"),
])
def test_bad_lora_values_are_refused(helm: str, sets: list[str], message: str) -> None:
    result = run_helm(helm, *template_args(sets=sets))
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
