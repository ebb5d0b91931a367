"""The Helm chart's values, rendered with a real helm: engine flags as the engine parses them, the model init step,
bad values failing with a clear message, the notes, and the values examples of the docs."""

from __future__ import annotations

from pathlib import Path

import pytest

from .chart import (
    CHART,
    KUBE_VERSION,
    RELEASE,
    component_of,
    container,
    flag,
    of_kind,
    render,
    render_notes,
    run_helm,
    template_args,
)

pytestmark = pytest.mark.helm


def test_engine_flags_render_as_the_engine_parses_them(helm: str) -> None:
    docs = render(helm, sets=["worker.engine.memFractionStatic=0.9", "worker.engine.maxTotalTokens=1000000",
                              "worker.engine.disableRadixCache=true", "workers.unified.extraArgs={--foo,bar}"])
    worker = next(d for d in of_kind(docs, "Deployment").values() if component_of(d) == "worker")
    args = container(worker)["args"]
    assert flag(args, "mem-fraction-static") == "0.9"
    assert flag(args, "max-total-tokens") == "1000000"
    assert "--disable-radix-cache" in args and "--disable-cuda-graph" not in args
    assert flag(args, "context-length") is None  # null: the engine's default
    assert args[-2:] == ["--foo", "bar"]
    assert flag(args, "kv-cache-dtype") == "auto" and flag(args, "quantization") is None


def test_fp8_values_render_as_engine_flags(helm: str) -> None:
    docs = render(helm, sets=["worker.engine.quantization=fp8", "worker.engine.kvCacheDtype=fp8_e4m3"])
    worker = next(d for d in of_kind(docs, "Deployment").values() if component_of(d) == "worker")
    args = container(worker)["args"]
    assert flag(args, "quantization") == "fp8" and flag(args, "kv-cache-dtype") == "fp8_e4m3"


def test_model_init_step_fetches_into_the_cache_volume(helm: str) -> None:
    docs = render(helm, sets=["model.source.type=init", "model.name=Qwen/Qwen2.5-1.5B-Instruct"])
    for dep in of_kind(docs, "Deployment").values():
        if component_of(dep) not in ("worker", "tokenizer", "grammar"):
            assert "initContainers" not in dep["spec"]["template"]["spec"]
            continue
        init = dep["spec"]["template"]["spec"]["initContainers"][0]
        assert init["command"][-1] == "Qwen/Qwen2.5-1.5B-Instruct"
        main_env = {e["name"]: e.get("value") for e in container(dep)["env"]}
        init_env = {e["name"]: e.get("value") for e in init["env"]}
        assert init_env["RADIXMESH_CACHE_DIR"] == main_env["RADIXMESH_CACHE_DIR"] == "/var/cache/radixmesh"
        assert main_env["HF_HUB_OFFLINE"] == "1" and "HF_HUB_OFFLINE" not in init_env
        assert {"name": "cache", "mountPath": "/var/cache/radixmesh"} in init["volumeMounts"]


BAD_VALUES = [
    (["workers.unified.replicas=-1"], "/workers/unified/replicas"),
    (["workers.draft.enabled=true"], "additional properties 'draft' not allowed"),
    (["redis.mode=cluster"], "/redis/mode"),
    (["gateway.replicas=two"], "/gateway/replicas"),
    (["router.policy=fastest"], "/router/policy"),
    (["worker.engine.attentionBackend=flash"], "/worker/engine/attentionBackend"),
    (["worker.engine.memFractionStatic=1.5"], "/worker/engine/memFractionStatic"),
    (["worker.engine.maxRunningRequest=8"], "additional properties 'maxRunningRequest' not allowed"),
    (["worker.engine.quantization=int4"], "/worker/engine/quantization"),
    (["worker.engine.kvCacheDtype=fp8"], "/worker/engine/kvCacheDtype"),
    (["worker.gpus=-1"], "/worker/gpus"),
    (["worker.port=70000"], "/worker/port"),
    (["model.source.type=s3"], "/model/source/type"),
    (["redis.external.url=http://x"], "/redis/external/url"),
    (["workers.decode.enabled=true"], "enable both workers.prefill and workers.decode"),
    (["workers.unified.enabled=false"], "enable at least one role"),
    (["redis.mode=external"], "redis.mode=external needs redis.external.url or redis.external.existingSecret"),
    (["model.source.type=pvc"], "model.source.pvc.claimName"),
    (["redis.mode=none", "router.discovery=redis"], "router.discovery=redis needs a Redis"),
    (["workers.unified.autoscaling.enabled=true"], "workers.unified.autoscaling: give targetCPUUtilizationPercentage"),
    (["tracing.otlpEndpoint=collector"], "/tracing/otlpEndpoint"),
    (["tracing.sampler=sometimes"], "/tracing/sampler"),
    (["tracing.samplerArg=half"], "/tracing/samplerArg"),
    (["otelCollector.exporters=null"], "/otelCollector"),
    (["otelCollector.exporters.Bad!.endpoint=x:1"], "invalid propertyName 'Bad!'"),
    (["grafana.dashboards.namespace=Monitoring"], "/grafana/dashboards/namespace"),
    (["grafana.dashboards.labels.grafana_dashboard=1"], "/grafana/dashboards/labels/grafana_dashboard"),
    (["gateway.grpcPort=70000"], "/gateway/grpcPort"),
    (["tls.public.enabled=true"], "tls.public.enabled needs tls.public.secretName"),
    (["tls.internal.enabled=true"], "tls.internal.enabled needs tls.internal.secretName"),
    (["tls.internal.enabled=true", "tls.internal.secretName=s", "tls.internal.healthPort=9090"],
     "tls.internal.healthPort must differ"),
    (["tls.certManager.enabled=true"], "tls.certManager.enabled needs tls.certManager.issuerRef.name"),
    (["tls.certManager.enabled=true", "tls.certManager.issuerRef.name=ca", "tls.public.enabled=true"],
     "tls.certManager with tls.public needs tls.public.dnsNames"),
    (["tls.internal.serverName=Bad_Name"], "/tls/internal/serverName"),
    (["tls.certManager.issuerRef.kind=Secret"], "/tls/certManager/issuerRef/kind"),
    (["worker.disagg.kvTransport=rdma"], "/worker/disagg/kvTransport"),
    (["worker.disagg.ucx.tcpPortRange=52000"], "/worker/disagg/ucx/tcpPortRange"),
]


def test_nixl_and_its_ucx_settings_render_for_the_pd_pods(helm: str) -> None:
    docs = render(helm, sets=["workers.unified.enabled=false", "workers.prefill.enabled=true",
                              "workers.decode.enabled=true", "worker.disagg.kvTransport=nixl",
                              "worker.disagg.ucx.tls=rc\\,cuda_copy\\,cuda_ipc",
                              "worker.disagg.ucx.netDevices=mlx5_0:1"])
    for name, deployment in of_kind(docs, "Deployment").items():
        if not name.endswith(("worker-prefill", "worker-decode")):
            continue
        worker = container(deployment)
        assert flag(worker["args"], "kv-transport") == "nixl", name
        env = {e["name"]: e.get("value") for e in worker["env"]}
        assert (env["UCX_TLS"], env["UCX_NET_DEVICES"]) == ("rc,cuda_copy,cuda_ipc", "mlx5_0:1"), name


@pytest.mark.parametrize(("sets", "message"), BAD_VALUES, ids=[s[0][0] for s in BAD_VALUES])
def test_bad_values_fail_with_a_clear_message(helm: str, sets: list[str], message: str) -> None:
    """`helm template` is `helm install` without a cluster: the same schema and template checks run."""
    result = run_helm(helm, *template_args(sets=sets))
    assert result.returncode != 0, f"{sets} rendered without error"
    assert message in result.stderr, result.stderr


def test_notes_tell_how_to_call_the_api(helm: str, tmp_path: Path) -> None:
    notes = render_notes(helm, tmp_path, sets=["gateway.apiKey.value=k"])
    assert f"port-forward svc/{RELEASE}-radixmesh-gateway 8000:8000" in notes
    assert "curl -s http://127.0.0.1:8000/v1/chat/completions" in notes
    assert 'Authorization: Bearer $RADIXMESH_API_KEY' in notes
    assert '"model": "smollm2-135m-instruct"' in notes
    assert "grpcurl -plaintext -H \"authorization: Bearer $RADIXMESH_API_KEY\"" in notes
    assert "127.0.0.1:50050 radixmesh.v1.InferenceService/Chat" in notes
    tls = render_notes(helm, tmp_path, [CHART / "examples" / "tls-cert-manager.yaml"])
    assert "curl -s --cacert ca.crt https://127.0.0.1:8000/v1/models" in tls
    assert "grpcurl -cacert ca.crt -authority llm.example.com" in tls
    plain = render_notes(helm, tmp_path, [CHART / "examples" / "pd-2p4d.yaml"])
    assert "Authorization" not in plain and '"model": "llama-3.1-8b-instruct"' in plain
    assert "prefill: 2 pod(s)" in plain and "decode: 4 pod(s)" in plain


@pytest.mark.parametrize("doc_path,section", [("docs/kubernetes.md", ""), ("README.md", "## Deploy on Kubernetes")])
def test_docs_values_example_renders_and_validates(helm: str, tmp_path: Path, doc_path: str, section: str) -> None:
    """The first values example of docs/kubernetes.md, and the one of the README's Kubernetes
    section, are working ones."""
    import re

    import kubernetes_validate

    text = (CHART.parents[1] / doc_path).read_text()
    if section:
        assert section in text, f"{doc_path} has no section {section!r}"
        text = text.split(section, 1)[1]
    example = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert example, f"{doc_path} has no yaml example"
    values = tmp_path / "my-values.yaml"
    values.write_text(example.group(1))
    docs = render(helm, [values])
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    worker = next(d for d in of_kind(docs, "Deployment").values() if component_of(d) == "worker")
    assert worker["spec"]["template"]["spec"]["initContainers"][0]["command"][-1] == "Qwen/Qwen2.5-1.5B-Instruct"
    assert container(worker)["image"] == "REGISTRY/radixmesh-worker:0.1.0"
