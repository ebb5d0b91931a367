"""The metric table of docs/observability.md, parsed (what the observability and chart tests check against)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "observability.md"
TYPES = ("counter", "gauge", "histogram")
MOVES = ("always", "structured", "level", "sometimes")
SERVICES = ("gateway", "serve", "tokenizer", "router", "worker", "grammar")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class DocMetric:
    """One row of the table."""

    name: str
    """As exposed: counters with `_total`, histograms by their base name."""
    type: str
    labels: tuple[str, ...]
    services: tuple[str, ...]
    moves: str

    @property
    def family(self) -> str:
        """The name prometheus_client's parser gives the family (a counter's without `_total`)."""
        return self.name.removesuffix("_total") if self.type == "counter" else self.name


def documented_metrics(doc: Path = DOC) -> list[DocMetric]:
    """Every row of the metric table; malformed rows fail loudly (the table is an interface)."""
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| `radixmesh_")]
    metrics = []
    for row in rows:
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        assert len(cells) == 6, f"metric row needs 6 cells: {row}"
        name, kind, labels, services, moves, meaning = cells
        name = name.strip("`")
        assert re.fullmatch(r"radixmesh_[a-z0-9_]+", name), row
        assert kind in TYPES, row
        assert moves in MOVES, row
        assert meaning, row
        service_list = tuple(s.strip() for s in services.split(","))
        assert service_list and set(service_list) <= set(SERVICES), row
        assert name.endswith("_total") == (kind == "counter"), f"counters (and only they) end in _total: {row}"
        metrics.append(DocMetric(name, kind, tuple(s.strip() for s in labels.split(",") if s.strip()),
                                 service_list, moves))
    names = [m.name for m in metrics]
    assert len(names) == len(set(names)), "a metric is listed twice"
    return metrics


def series_metric(series: str, documented: dict[str, DocMetric]) -> DocMetric | None:
    """The documented metric a series name in a query belongs to (`x_bucket` -> histogram `x`), or None."""
    if series in documented:
        return documented[series]
    for suffix in HISTOGRAM_SUFFIXES:
        base = documented.get(series.removesuffix(suffix))
        if series.endswith(suffix) and base is not None and base.type == "histogram":
            return base
    return None
