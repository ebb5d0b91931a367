"""Render the Helm chart with the real `helm` binary and look at the manifests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "radixmesh"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
KUBE_VERSION = "1.37.0"
"""Kubernetes version the chart is rendered for and validated against."""
RELEASE = "rm"
NAMESPACE = "serving"


def find_helm() -> str | None:
    """helm next to this Python (scripts/install.sh test builds it into .venv/bin), else on PATH."""
    beside = Path(sys.executable).parent / "helm"
    return str(beside) if beside.is_file() else shutil.which("helm")


@dataclass
class HelmResult:
    returncode: int
    stdout: str
    stderr: str


def run_helm(helm: str, *args: str) -> HelmResult:
    proc = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, check=False)
    return HelmResult(proc.returncode, proc.stdout, proc.stderr)


def template_args(values_files: list[Path] | None = None, sets: list[str] | None = None,
                  chart: Path = CHART, show_only: str | None = None) -> list[str]:
    args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    for path in values_files or []:
        args += ["-f", str(path)]
    for item in sets or []:
        args += ["--set", item]
    if show_only:
        args += ["--show-only", show_only]
    return args


def render(helm: str, values_files: list[Path] | None = None, sets: list[str] | None = None,
           chart: Path = CHART, show_only: str | None = None) -> list[dict[str, Any]]:
    result = run_helm(helm, *template_args(values_files, sets, chart, show_only))
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def render_notes(helm: str, workdir: Path, values_files: list[Path] | None = None,
                 sets: list[str] | None = None) -> str:
    """NOTES.txt as `helm install` prints it, rendered through a copy of the chart (in `workdir`) that puts
    it in a ConfigMap (helm template skips NOTES)."""
    chart = workdir / "radixmesh"
    if not chart.exists():
        shutil.copytree(CHART, chart)
        shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.txt")
        (chart / "templates" / "notes-render.yaml").write_text(
            'apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n  notes: |\n'
            '{{ tpl (.Files.Get "notes.txt") . | indent 4 }}\n')
    docs = render(helm, values_files, sets, chart=chart, show_only="templates/notes-render.yaml")
    return str(docs[0]["data"]["notes"])


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def component_of(doc: dict[str, Any]) -> str:
    return str(doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"])


def container(deployment: dict[str, Any], index: int = 0) -> dict[str, Any]:
    containers: list[dict[str, Any]] = deployment["spec"]["template"]["spec"]["containers"]
    return containers[index]


def flag(args: list[str], name: str) -> str | None:
    """Value of --name=value in a container's args (None when absent)."""
    prefix = f"--{name}="
    values = [a[len(prefix):] for a in args if a.startswith(prefix)]
    assert len(values) <= 1, f"--{name} given {len(values)} times: {args}"
    return values[0] if values else None


def parse_selector(text: str) -> dict[str, str]:
    return dict(term.split("=", 1) for term in text.split(","))


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())
