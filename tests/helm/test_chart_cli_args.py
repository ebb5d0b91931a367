"""Every container the chart runs parses with the real `radixmesh` command line (chart and CLI agree)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path

import pytest

from .chart import CHART, component_of, container, of_kind, render

pytestmark = pytest.mark.helm

VALUE_FILES = [None, CHART / "examples" / "pd-2p4d.yaml", CHART / "examples" / "external-redis.yaml",
               CHART / "examples" / "observability.yaml", CHART / "examples" / "tls-cert-manager.yaml",
               CHART / "examples" / "hicache-2gpu.yaml"]


def _parse(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """None when args parse, else argparse's error message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(args)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    return None


@pytest.mark.parametrize("values_file", VALUE_FILES, ids=lambda p: p.stem if p else "defaults")
def test_container_args_parse(helm: str, values_file: Path | None) -> None:
    from radixmesh.cli import build_parser

    parser = build_parser()
    errors = []
    for dep in of_kind(render(helm, [values_file] if values_file else []), "Deployment").values():
        if component_of(dep) in ("redis", "otel-collector"):
            continue
        c = container(dep)
        assert c["command"] == ["radixmesh"]
        args = [re.sub(r"\$\((\w+)\)", "x", a) for a in c["args"]]  # kubelet expands $(VAR) from env
        error = _parse(parser, args)
        if error:
            errors.append(f"{dep['metadata']['name']}: radixmesh {' '.join(args[:2])} ...: {error}")
    assert not errors, "\n".join(errors)
