"""One set of model flags: every command that loads a model or its tokenizer parses the same ones."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from radixmesh.cli import build_parser
from radixmesh.cluster.spec import ClusterSpec, ClusterState
from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.args import MODEL_FLAGS, model_kwargs
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.loader import prepare_model, resolve_tokenizer

COMMANDS = {
    "serve": ["serve"],
    "generate": ["generate", "--prompt", "hi"],
    "worker": ["worker"],
    "tokenizer": ["tokenizer"],
    "grammar": ["grammar"],
    "bench offline": ["bench", "offline"],
    "bench one-batch": ["bench", "one-batch"],
    "bench structured": ["bench", "structured"],
    "bench routing": ["bench", "routing"],
    "cluster up": ["cluster", "up"],
}
MODEL_ARGV = ["--model", "/models/m", "--load-format", "dummy", "--tokenizer", "org/tok", "--dtype", "bfloat16",
              "--context-length", "512"]
EXPECTED = {"model": "/models/m", "load_format": "dummy", "tokenizer": "org/tok", "dtype": "bfloat16",
            "context_length": 512}
DEFAULTS = {"model": None, "load_format": "auto", "tokenizer": None, "dtype": "auto", "context_length": None}
DUMMY_BY_DEFAULT = {"bench offline", "bench one-batch", "bench structured"}
"""Engine benchmarks run random weights of a shape unless told otherwise."""


def _subparser(argv: list[str]) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in argv:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
        if word == argv[-1] or not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
            break
    return parser


def _model_actions(parser: argparse.ArgumentParser) -> dict[str, tuple[Any, ...]]:
    return {a.dest: (tuple(a.option_strings), tuple(a.choices or ()), a.type)
            for a in parser._actions if a.dest in MODEL_FLAGS}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_parses_the_same_model_flags(name: str) -> None:
    parser = build_parser()
    assert model_kwargs(parser.parse_args(COMMANDS[name] + MODEL_ARGV)) == EXPECTED
    defaults = {**DEFAULTS, "load_format": "dummy"} if name in DUMMY_BY_DEFAULT else DEFAULTS
    assert model_kwargs(parser.parse_args(COMMANDS[name])) == defaults


def test_the_model_flags_are_declared_identically_everywhere() -> None:
    declared = {name: _model_actions(_subparser(argv[:2] if argv[0] in ("bench", "cluster") else argv[:1]))
                for name, argv in COMMANDS.items()}
    reference = declared["serve"]
    assert set(reference) == set(MODEL_FLAGS)
    for name, actions in declared.items():
        assert actions == reference, name


def test_help_lists_the_model_flags() -> None:
    for argv in COMMANDS.values():
        text = _subparser(argv[:2] if argv[0] in ("bench", "cluster") else argv[:1]).format_help()
        for flag in ("--model", "--load-format", "--tokenizer", "--dtype", "--context-length"):
            assert flag in text, (argv, flag)


def test_engine_config_takes_the_model_flags() -> None:
    config = EngineConfig(**model_kwargs(build_parser().parse_args(["serve", *MODEL_ARGV])))
    assert (config.tokenizer, config.load_format, config.dtype, config.context_length) == \
        ("org/tok", "dummy", "bfloat16", 512)


def test_cluster_up_hands_one_set_of_flags_to_every_model_service(monkeypatch: pytest.MonkeyPatch) -> None:
    import radixmesh.cluster.local as local

    specs: list[ClusterSpec] = []

    def fake_up(spec: ClusterSpec) -> None:
        specs.append(spec)
        raise RadixMeshError(local.ErrorCode.UNAVAILABLE, "not starting anything in a unit test")

    monkeypatch.setattr(local, "cluster_up", fake_up)
    per_service = ["--tokenizer-args", "--block-size 32", "--gateway-args", "--max-queued-requests 4",
                   "--grammar-args", "--compile-threads 1", "--worker-args", "--max-total-tokens 64"]
    args = build_parser().parse_args(["cluster", "up", *MODEL_ARGV, "--routers", "3", *per_service])
    with pytest.raises(RadixMeshError):
        args.func(args)
    spec = specs.pop()
    assert spec.model_args() == MODEL_ARGV
    assert spec.num_routers == 3 and spec.router_names() == ["router-0", "router-1", "router-2"]
    assert (spec.tokenizer_args, spec.gateway_args, spec.grammar_args, spec.worker_args) == \
        ("--block-size 32", "--max-queued-requests 4", "--compile-threads 1", "--max-total-tokens 64")


def test_cluster_spec_defaults_pass_no_model_flags_and_one_router() -> None:
    spec = ClusterSpec()
    assert spec.model_args() == [] and spec.router_names() == ["router"]
    assert ClusterSpec(num_routers=0).router_names() == []  # the gateway routes in its own process
    assert ClusterSpec(model="m", load_format="dummy").model_args() == ["--model", "m", "--load-format", "dummy"]


@pytest.mark.parametrize(("kwargs", "message"), [({"num_routers": -1}, "routers must be >= 0"),
                                                 ({"load_format": "bin"}, "load_format"),
                                                 ({"dtype": "int4"}, "dtype"),
                                                 ({"context_length": 1}, "context_length")])
def test_cluster_spec_refuses_bad_model_flags(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(RadixMeshError, match=message):
        ClusterSpec(**kwargs)


def test_old_state_files_load_without_the_router_list(tmp_path: Path) -> None:
    old = {"gateway_url": "http://h:1", "router_address": "h:2", "tokenizer_address": "h:3",
           "worker_addresses": ["h:4"], "redis_url": None, "policy": "cache-aware", "log_dir": "/tmp"}
    (tmp_path / "state.json").write_text(json.dumps(old))
    state = ClusterState.load(tmp_path)
    assert state is not None and state.router_addresses == [] and state.router_address == "h:2"


# ---- tokenizer-only loading: no weights needed -------------------------------------------------------------
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 32,
               "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
               "max_position_embeddings": 128}


@pytest.fixture()
def weightless_dir(tmp_path: Path) -> Path:
    """config.json and a tokenizer file, no checkpoint."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


def test_tokenizer_services_need_no_weights(weightless_dir: Path) -> None:
    for load_format in ("auto", "dummy"):
        prepared = prepare_model(str(weightless_dir), load_format, need_weights=False)
        assert prepared.tokenizer_path == weightless_dir.resolve() or prepared.tokenizer_path == weightless_dir
    with pytest.raises(RadixMeshError, match="no safetensors weights"):
        prepare_model(str(weightless_dir), "auto")


def test_tokenizer_flag_replaces_the_models_tokenizer(weightless_dir: Path, tmp_path_factory: Any) -> None:
    other = tmp_path_factory.mktemp("tok")
    (other / "tokenizer_config.json").write_text("{}")
    prepared = prepare_model(str(weightless_dir), "dummy", tokenizer=str(other))
    assert prepared.tokenizer_path == other.resolve()
    assert resolve_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(RadixMeshError, match="no tokenizer files"):
        resolve_tokenizer(str(empty))
    with pytest.raises(RadixMeshError, match="not found"):
        resolve_tokenizer("/no/such/tokenizer/dir")


def test_cluster_up_command_lines(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Which flags each service is started with: model flags to model services only, N routers on one Redis."""
    import radixmesh.cluster.local as local

    started: dict[str, list[str]] = {}

    def start(self: local._Starter, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        started[name] = args
        self.pids[name] = 1

    monkeypatch.setattr(local._Starter, "start", start)
    monkeypatch.setattr(local._Starter, "wait", lambda self, name, ready, what: None)
    spec = ClusterSpec(num_workers=2, num_routers=2, redis_url="redis://127.0.0.1:1/0", model="/m",
                       load_format="dummy", tokenizer="/t", grammar=True, state_dir=tmp_path,
                       tokenizer_args="--block-size 32", grammar_args="--compile-threads 1",
                       gateway_args="--max-queued-requests 4", router_args="--health-interval-s 0.5")
    state = local.cluster_up(spec)
    model = ["--model", "/m", "--load-format", "dummy", "--tokenizer", "/t"]
    for name in ("worker-0", "worker-1", "tokenizer", "grammar"):
        assert _has_run(started[name], model), name
    for name in ("router-0", "router-1", "gateway"):
        assert "--model" not in started[name] and "--load-format" not in started[name], name
    assert _has_run(started["tokenizer"], ["--block-size", "32"])
    assert _has_run(started["grammar"], ["--compile-threads", "1"])
    assert _has_run(started["gateway"], ["--max-queued-requests", "4"])
    routers = state.router_addresses
    assert len(set(routers)) == 2 and state.router_address == routers[0]
    assert state.router_names == ["router-0", "router-1"] and {"router-0", "router-1"} <= set(state.pids)
    for name, address in zip(state.router_names, routers):
        args = started[name]
        assert args[args.index("--port") + 1] == address.rsplit(":", 1)[1]
        assert _has_run(args, ["--workers", ",".join(state.worker_addresses)])
        assert _has_run(args, ["--redis-url", "redis://127.0.0.1:1/0", "--health-interval-s", "0.5"])
    assert _has_run(started["gateway"], ["--router", ",".join(routers)])
    assert ClusterState.load(tmp_path) == state


def _has_run(args: list[str], run: list[str]) -> bool:
    return any(args[i:i + len(run)] == run for i in range(len(args)))
