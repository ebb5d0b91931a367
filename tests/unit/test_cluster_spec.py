"""`radixmesh cluster up`: which workers a spec starts, and the worker counts it refuses."""

from __future__ import annotations

import pytest

from radixmesh.cli import build_parser
from radixmesh.cluster.local import ClusterSpec
from radixmesh.common.errors import RadixMeshError


def test_unified_by_default_and_tiers_on_request() -> None:
    assert ClusterSpec().worker_roles() == [("worker-0", "unified"), ("worker-1", "unified")]
    spec = ClusterSpec(num_workers=0, num_prefill_workers=1, num_decode_workers=2)
    assert spec.worker_roles() == [("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")]


@pytest.mark.parametrize(("counts", "message"), [((0, 0, 0), "at least one unified or decode"),
                                                 ((1, 2, 0), "need decode workers"),
                                                 ((1, -1, 1), ">= 0")])
def test_bad_worker_counts_are_refused(counts: tuple[int, int, int], message: str) -> None:
    unified, prefill, decode = counts
    with pytest.raises(RadixMeshError, match=message):
        ClusterSpec(num_workers=unified, num_prefill_workers=prefill, num_decode_workers=decode)


def test_cli_decode_workers_replace_the_default_unified_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    import radixmesh.cluster.local as local

    specs: list[ClusterSpec] = []

    def fake_up(spec: ClusterSpec) -> None:
        specs.append(spec)
        raise RadixMeshError(local.ErrorCode.UNAVAILABLE, "not starting anything in a unit test")

    monkeypatch.setattr(local, "cluster_up", fake_up)
    for argv, expected in ((["cluster", "up"], (2, 0, 0)),
                           (["cluster", "up", "--prefill-workers", "1", "--decode-workers", "2"], (0, 1, 2)),
                           (["cluster", "up", "--workers", "1", "--decode-workers", "1"], (1, 0, 1))):
        args = build_parser().parse_args(argv)
        with pytest.raises(RadixMeshError):
            args.func(args)
        spec = specs.pop()
        assert (spec.num_workers, spec.num_prefill_workers, spec.num_decode_workers) == expected
