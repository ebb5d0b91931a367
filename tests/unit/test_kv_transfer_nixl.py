"""The nixl KV transport on CPU pools with the real NIXL library: its descriptor lists, its modes (rows in place,
or staged), the metadata exchanged once per peer, what auto picks, and a clear error without the library."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.disagg.transport import nixl_descs as descs
from radixmesh.engine.disagg.transport import nixl_lib
from radixmesh.engine.disagg.transport.choice import (
    ReceiverInfo,
    choose_transport,
    decode_receiver_info,
    encode_receiver_info,
)
from radixmesh.engine.disagg.transport.registry import check_transport_device, create_transport
from radixmesh.engine.memory import TokenToKVPool

needs_nixl = pytest.mark.skipif(not nixl_lib.nixl_available(), reason="NIXL is not installed (radixmesh[nixl])")


# ---- descriptors ----------------------------------------------------------------------------------
def test_runs_split_where_either_side_stops_being_contiguous() -> None:
    src = np.array([5, 6, 7, 20, 21, 22, 23], dtype=np.int64)
    dst = np.array([1, 2, 9, 10, 11, 12, 13], dtype=np.int64)
    assert descs.run_starts(src).tolist() == [0, 3]
    assert descs.num_joint_runs(src, dst) == 3  # [5,6]->[1,2], [7]->[9], [20..23]->[10..13]
    assert descs.expand_runs(np.array([[5, 3], [20, 4]], dtype=np.int64)).tolist() == src.tolist()
    local = descs.pool_space([1000, 2000], [3000, 4000], dst, 0)
    remote = descs.pool_space([10_000, 20_000], [30_000, 40_000], src, 0)
    local_d, remote_d = descs.read_descriptors(local, remote, 8)
    assert local_d.shape == (4 * 3, 3)  # 2 layers x K/V x 3 joint runs, none mergeable (separate buffers)
    assert local_d[:3, :2].tolist() == [[1000 + 8, 16], [1000 + 72, 8], [1000 + 80, 32]]
    assert remote_d[:3, :2].tolist() == [[10_000 + 40, 16], [10_000 + 56, 8], [10_000 + 160, 32]]
    assert int(local_d[:, 1].sum()) == 4 * 7 * 8


def test_two_packed_regions_make_one_descriptor_and_bytes_land_where_they_belong() -> None:
    rows = np.random.default_rng(0).permutation(64)[:10].astype(np.int64) + 1
    packed_local = descs.packed_space(5000, num_layers=3, num_tokens=10, row_bytes=16, device_id=0)
    packed_remote = descs.packed_space(90_000, num_layers=3, num_tokens=10, row_bytes=16, device_id=0)
    local_d, remote_d = descs.read_descriptors(packed_local, packed_remote, 16)
    assert local_d.tolist() == [[5000, 3 * 2 * 10 * 16, 0]] and remote_d.tolist() == [[90_000, 960, 0]]
    # pool rows into a packed region: every (set, token) byte range appears once, at its packed place
    local_d, remote_d = descs.read_descriptors(packed_local, descs.pool_space([0, 10**6, 2 * 10**6],
                                                                               [3 * 10**6, 4 * 10**6, 5 * 10**6],
                                                                               rows, 0), 16)
    covered = sorted((int(a) - 5000, int(n)) for a, n, _ in local_d)
    assert sum(n for _, n in covered) == 960 and all(b[0] == a[0] + a[1] for a, b in itertools.pairwise(covered))


# ---- choice ---------------------------------------------------------------------------------------
HOST = "boot-1/ipc:[1]"


@pytest.mark.parametrize(("local", "receiver", "expected"), [
    (ReceiverInfo(HOST, "cuda", ["g0", "g1"], True), ReceiverInfo(HOST, "cuda", ["g1", "g0"], True), "cuda-ipc"),
    (ReceiverInfo(HOST, "cuda", ["g0"], True), ReceiverInfo(HOST, "cuda", ["g1"], True), "nixl"),
    (ReceiverInfo(HOST, "cuda", ["g0", "g1"], True), ReceiverInfo("boot-2/ipc:[1]", "cuda", ["g1", "g0"], True),
     "nixl"),
    (ReceiverInfo(HOST, "cpu", [], True), ReceiverInfo(HOST, "cpu", [], True), "nixl"),
    (ReceiverInfo(HOST, "cuda", ["g0"], False), ReceiverInfo("other", "cuda", ["g1"], True), "grpc"),
    (ReceiverInfo(HOST, "cuda", ["g0"], True), None, "grpc"),
])
def test_auto_prefers_cuda_ipc_then_nixl_then_grpc(local: ReceiverInfo, receiver: ReceiverInfo | None,
                                                  expected: str) -> None:
    chosen, why = choose_transport("auto", receiver, local)
    assert chosen == expected and why
    assert choose_transport("grpc", receiver, local)[0] == "grpc"  # a fixed id is never overridden


def test_receiver_info_round_trips_and_garbage_reads_as_unknown() -> None:
    info = ReceiverInfo(HOST, "cuda", ["g0"], True, ["agent-a"])
    assert decode_receiver_info(encode_receiver_info(info)) == info
    assert decode_receiver_info(b"") is None and decode_receiver_info(b"\x93not info") is None


def test_asking_for_nixl_without_the_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_lib, "_find", lambda: None)
    with pytest.raises(RadixMeshError, match=r"radixmesh\[nixl\]") as err:
        check_transport_device("nixl", "cpu")
    assert err.value.param == "kv_transport"
    check_transport_device("auto", "cpu")  # auto falls back to grpc instead


def test_worker_transport_settings_combine() -> None:
    from radixmesh.worker.config import WorkerConfig

    assert WorkerConfig().kv_transport == "auto"
    assert WorkerConfig(kv_transport="nixl").serving_transport("auto") == "nixl"
    assert WorkerConfig().serving_transport("nixl") == "nixl"
    assert WorkerConfig().serving_transport("auto") == "auto"
    with pytest.raises(RadixMeshError, match="sends KV over grpc"):
        WorkerConfig(kv_transport="grpc").serving_transport("nixl")


def test_options_come_from_the_environment_and_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXMESH_NIXL_MODE", "staging")
    monkeypatch.setenv("RADIXMESH_NIXL_STAGING_MB", "8")
    options = nixl_lib.NixlOptions.from_env()
    assert (options.mode, options.staging_bytes) == ("staging", 8 * 2**20)
    monkeypatch.setenv("RADIXMESH_NIXL_MODE", "rdma")
    with pytest.raises(RadixMeshError, match="nixl mode"):
        nixl_lib.NixlOptions.from_env()


# ---- the transport --------------------------------------------------------------------------------
def make_pool(dtype: torch.dtype = torch.float32, size: int = 300, seed: int | None = None) -> TokenToKVPool:
    pool = TokenToKVPool(size, 3, 2, 8, dtype, "cpu")
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        for buf in (*pool.k_buffers, *pool.v_buffers):
            buf.copy_(torch.randn(buf.shape, generator=generator))
    return pool


def landed(src: TokenToKVPool, src_slots: torch.Tensor, dst: TokenToKVPool, dst_slots: torch.Tensor) -> bool:
    return all(torch.equal(d[dst_slots], s[src_slots])
               for s, d in zip((*src.k_buffers, *src.v_buffers), (*dst.k_buffers, *dst.v_buffers)))


def exported(sender: Any, transfer_id: str, slots: torch.Tensor, info: ReceiverInfo | None = None) -> list[Any]:
    """The chunks as an exporting worker sends them: export, then ready_to_send makes nixl's final."""
    placeholder = sender.export(transfer_id, slots, info)
    assert len(placeholder) == 1 and placeholder[0].data == b"", "nixl's chunk is made when it leaves"
    chunks: list[Any] = sender.ready_to_send(transfer_id)
    return chunks


def wait(pending: Any) -> None:
    assert pending is not None, "a nixl receive is pending until polled"
    while not pending.poll():
        pass


@needs_nixl
@pytest.mark.parametrize("mode", ["direct", "staging", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_layer_lands_in_the_reserved_slots(mode: str, dtype: torch.dtype) -> None:
    src, dst = make_pool(dtype, seed=1), make_pool(dtype)
    sender, receiver = create_transport("nixl", src, mode=mode), create_transport("nixl", dst, mode=mode)
    generator = torch.Generator().manual_seed(2)
    layouts = [(torch.arange(40, 120), torch.arange(200, 280)),  # one run each side
               (torch.randperm(300, generator=generator)[:80] + 1, torch.randperm(300, generator=generator)[:80] + 1)]
    for i, (src_slots, dst_slots) in enumerate(layouts):
        info = ReceiverInfo(nixl_agents=receiver.receiver_agents())  # type: ignore[attr-defined]
        chunks = exported(sender, f"t{i}", src_slots, info)
        assert len(chunks) == 1 and chunks[0].num_bytes == 2 * 3 * 80 * 2 * 8 * dtype.itemsize
        wait(receiver.receive(chunks[0], dst_slots))
        assert landed(src, src_slots, dst, dst_slots), (mode, i)
        sender.release(f"t{i}")
    stats = sender.stats()
    assert stats["nixl_metadata_sent"] == 1  # the second export found its agent in the receiver's list
    assert stats["nixl_staging_regions"] == 0 and receiver.stats()["nixl_staging_regions"] == 0
    assert receiver.stats()["nixl_reads_in_flight"] == 0 and receiver.stats()["nixl_remote_agents"] == 1
    expected_staged = {"direct": 0, "staging": 2, "auto": 2}[mode]  # auto: 80 rows of <= 64 B are too fragmented
    assert stats["nixl_exports_staged"] == expected_staged


@needs_nixl
def test_long_runs_go_in_place_in_auto_mode_and_fragmented_rows_are_staged() -> None:
    src, dst = make_pool(seed=3, size=4096), make_pool(size=4096)
    options = nixl_lib.NixlOptions(min_run_bytes=4096)
    sender = create_transport("nixl", src, options=options)
    receiver = create_transport("nixl", dst, options=options)
    src_slots, dst_slots = torch.arange(1, 1001), torch.arange(2001, 3001)  # 1000 rows of 64 B: one run, 64 KB
    wait(receiver.receive(exported(sender, "long", src_slots)[0], dst_slots))
    assert sender.stats()["nixl_exports_direct"] == 1 and receiver.stats()["nixl_reads_direct"] == 1
    scattered = dst_slots[torch.randperm(1000)]  # contiguous on the prefill side, scattered here: staged here
    wait(receiver.receive(exported(sender, "mixed", src_slots)[0], scattered))
    assert receiver.stats()["nixl_reads_staged"] == 1 and landed(src, src_slots, dst, scattered)


@needs_nixl
def test_a_chunk_that_does_not_fit_is_refused_before_anything_moves() -> None:
    src, dst = make_pool(seed=4), make_pool()
    sender, receiver = create_transport("nixl", src), create_transport("nixl", dst)
    chunk = exported(sender, "x", torch.arange(1, 11))[0]
    with pytest.raises(RadixMeshError, match="slots are reserved"):
        receiver.receive(chunk, torch.arange(1, 9))
    other = create_transport("nixl", TokenToKVPool(64, 3, 2, 4, torch.float32, "cpu"))
    with pytest.raises(RadixMeshError, match="rows are"):
        other.receive(chunk, torch.arange(1, 11))
    assert receiver.stats()["nixl_reads_in_flight"] == 0
