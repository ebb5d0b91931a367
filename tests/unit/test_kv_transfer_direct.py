"""cuda-ipc's direct mode without IPC: the slot ring's allocator, and export -> receive between two pools of this
process through a fake of the CUDA IPC calls (sharing registers a tensor, opening returns it). Without CUDA the pools
are on the CPU and the pull kernel runs under the Triton interpreter. The real IPC path runs in
tests/gpu/test_kv_transfer_gpu.py."""

from __future__ import annotations

import os
import random

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton (radixmesh.kernels): @triton.jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.disagg.transport import ipc_direct
from radixmesh.engine.disagg.transport.cuda_ipc import IpcHandle, _decoder, _encoder
from radixmesh.engine.disagg.transport.ipc import SharedBuffer
from radixmesh.engine.disagg.transport.ipc_direct import DirectExporter, DirectReceiver, DirectRef
from radixmesh.engine.disagg.transport.slot_ring import SlotRing
from radixmesh.engine.memory import TokenToKVPool

DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

# ---- the slot ring ----------------------------------------------------------------------------------
def test_ring_hands_out_disjoint_regions_and_frees_them_out_of_order() -> None:
    ring = SlotRing(10)
    assert [ring.allocate("a", 4), ring.allocate("b", 3), ring.allocate("c", 3)] == [0, 4, 7]
    assert ring.allocate("d", 1) is None  # full
    ring.free("b")
    assert ring.allocate("d", 4) is None  # the gap is 3 long
    assert ring.allocate("d", 2) == 4
    ring.free("a")
    ring.free("a")  # twice: no-op
    assert ring.allocate("e", 4) == 0
    assert ring.region("e") == (0, 4) and ring.region("a") is None
    assert len(ring) == 3 and ring.num_used == 9
    with pytest.raises(AssertionError, match="already allocated"):
        ring.allocate("e", 1)


def test_ring_allocates_next_fit_after_the_last_region() -> None:
    ring = SlotRing(10)
    ring.allocate("a", 2)
    ring.allocate("b", 2)
    ring.free("a")
    assert ring.allocate("c", 2) == 4  # not the freed [0, 2): regions just freed are reused last
    ring.allocate("d", 4)
    assert ring.allocate("e", 2) == 0  # wraps around


def test_random_ring_traffic_never_overlaps_and_fails_only_when_full() -> None:
    rng = random.Random(0)
    ring, live = SlotRing(100), {}
    for step in range(2000):
        if live and rng.random() < 0.45:
            key = rng.choice(sorted(live))
            ring.free(key)
            del live[key]
            continue
        length = rng.randint(1, 30)
        offset = ring.allocate(f"t{step}", length)
        used = [False] * 100
        for begin, n in live.values():
            used[begin:begin + n] = [True] * n
        fits = any(not any(used[s:s + length]) for s in range(100 - length + 1))
        assert (offset is not None) == fits, (step, length, sorted(live.values()))
        if offset is not None:
            assert offset >= 0 and offset + length <= 100 and not any(used[offset:offset + length])
            live[f"t{step}"] = (offset, length)


# ---- export -> receive through a fake of CUDA IPC --------------------------------------------------
class FakeIpc:
    """CUDA IPC within one process on the CPU: `share` registers a tensor under a new handle, `open` returns it."""

    def __init__(self, peer_access: bool = True) -> None:
        self.peer_access = peer_access
        self.tensors: dict[bytes, torch.Tensor] = {}
        self.num_opened = 0
        self.waited: list[bytes] = []
        self.live_events = 0

    def device_uuid(self, device: torch.device) -> str:
        return "GPU-fake"

    def local_device(self, uuid: str) -> torch.device:
        assert uuid == "GPU-fake"
        return DEVICE

    def can_access_peer(self, device: torch.device, peer: torch.device) -> bool:
        return self.peer_access

    def share(self, tensor: torch.Tensor) -> SharedBuffer:
        handle = f"handle-{len(self.tensors)}".encode()
        self.tensors[handle] = tensor
        return SharedBuffer(handle, tensor.nbytes, 0, b"counter", 0)

    def open(self, buf: SharedBuffer, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        self.num_opened += 1
        tensor = self.tensors[buf.handle]
        assert tensor.dtype == dtype and tuple(tensor.shape) == shape, (tensor.dtype, tensor.shape, dtype, shape)
        return tensor

    def record_event(self, device: torch.device) -> tuple[object, bytes]:
        self.live_events += 1
        return object(), f"event-{self.live_events}".encode()

    def wait_event(self, handle: bytes, device: torch.device) -> object:
        self.waited.append(handle)
        return object()


def make_pool(size: int, seed: int | None = None, num_layers: int = 3, dtype: torch.dtype = torch.bfloat16
              ) -> TokenToKVPool:
    pool = TokenToKVPool(size, num_layers, 2, 8, dtype, DEVICE)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for buf in (*pool.k_buffers, *pool.v_buffers):
            buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype).to(DEVICE))
    return pool


def assert_moved(src: TokenToKVPool, src_slots: torch.Tensor, dst: TokenToKVPool, dst_slots: torch.Tensor) -> None:
    for layer in range(src.num_layers):
        for src_buf, dst_buf in ((src.k_buffers[layer], dst.k_buffers[layer]),
                                 (src.v_buffers[layer], dst.v_buffers[layer])):
            assert torch.equal(dst_buf[dst_slots].view(torch.uint8), src_buf[src_slots].view(torch.uint8)), layer


@pytest.mark.parametrize("peer_access", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_direct_transfers_move_every_layer_and_map_the_pool_once(peer_access: bool, dtype: torch.dtype) -> None:
    ipc = FakeIpc(peer_access)  # without peer access: the gather on the prefill GPU, copy and scatter
    prefill, decode = make_pool(40, seed=1, dtype=dtype), make_pool(50, dtype=dtype)
    exporter, receiver = DirectExporter(prefill, ipc), DirectReceiver(decode, ipc)
    for transfer, (src, dst) in enumerate([([7, 3, 39, 12, 1], [40, 2, 17, 33, 5]), ([20, 21], [1, 50])]):
        src_slots, dst_slots = torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE)
        ref = exporter.export(f"t{transfer}", src_slots)
        assert ref is not None and ref.num_rows == 41 and len(ref.k_buffers) == 3
        receiver.receive(_decoder.decode(_encoder.encode(ref)), dst_slots)  # as it travels
        receiver.finished()
        assert_moved(prefill, src_slots, decode, dst_slots)
        assert len(ipc.tensors) == ipc.num_opened == 2 * 3 + 1  # each layer's K and V and the ring, once
    assert ipc.waited == [b"event-1", b"event-2"]  # each pull waited on its export's event


def test_regions_are_freed_on_release_and_a_full_ring_declines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ipc_direct, "MIN_RING_ENTRIES", 1)
    ipc = FakeIpc()
    exporter = DirectExporter(make_pool(40, seed=1), ipc)
    assert exporter.ring_len == 82
    slots = torch.arange(1, 41, device=DEVICE).repeat(2)[:50]
    first = exporter.export("a", slots)
    assert first is not None and first.ring_offset == 0
    assert exporter.export("b", slots) is None  # 32 entries left: the transport exports this one staged
    assert exporter.export("c", torch.empty(0, dtype=torch.int64, device=DEVICE)) is None
    exporter.release("a")
    exporter.release("b")  # never got a region: no-op
    second = exporter.export("b", slots)
    assert second is not None and second.ring_offset == 0
    ring = ipc.tensors[second.ring.handle]
    assert torch.equal(ring[:50], slots)


def test_the_receiver_keeps_the_last_few_prefill_pools_mapped() -> None:
    ipc = FakeIpc()
    decode = make_pool(50)
    receiver = DirectReceiver(decode, ipc, max_remote_pools=2)
    prefills = [make_pool(20, seed=seed) for seed in range(3)]
    exporters = [DirectExporter(pool, ipc) for pool in prefills]
    slots = torch.tensor([3, 9], device=DEVICE)

    def transfer(index: int) -> None:
        ref = exporters[index].export(f"t{ipc.live_events}", slots)
        assert ref is not None
        receiver.receive(ref, slots)
        receiver.finished()
        assert_moved(prefills[index], slots, decode, slots)

    for index in (0, 1, 0, 2):
        transfer(index)
    assert receiver.num_remote_pools == 2 and ipc.num_opened == 3 * 7  # pool 1 was least recently used
    transfer(0)
    assert ipc.num_opened == 3 * 7
    transfer(1)  # mapped again
    assert ipc.num_opened == 4 * 7


def test_a_transfer_that_does_not_fit_is_refused() -> None:
    ipc = FakeIpc()
    exporter = DirectExporter(make_pool(40, seed=1), ipc)
    slots = torch.tensor([1, 2, 3], device=DEVICE)
    ref = exporter.export("t", slots)
    assert ref is not None
    cases = {"KV heads": DirectReceiver(TokenToKVPool(50, 3, 1, 8, torch.bfloat16, DEVICE), ipc),
             "layers": DirectReceiver(make_pool(50, num_layers=2), ipc)}
    for match, receiver in cases.items():
        with pytest.raises(RadixMeshError, match=match):
            receiver.receive(ref, slots)
    receiver = DirectReceiver(make_pool(50), ipc)
    with pytest.raises(RadixMeshError, match="outside the prefill side's ring"):
        receiver.receive(DirectRef(**{**_fields(ref), "ring_offset": ref.ring_len - 2}), slots)
    assert ipc.num_opened == 0


def test_chunk_data_names_its_mode() -> None:
    staged = IpcHandle("GPU-x", 0, b"h", 10, 0, b"c", 0, b"e", True, [1, 2, 1, 2, 8])
    assert _decoder.decode(_encoder.encode(staged)) == staged
    ref = DirectRef("GPU-x", [SharedBuffer(b"k", 8, 0, b"c", 1)], [SharedBuffer(b"v", 8, 0, b"c", 2)], 5, 2, 8,
                    SharedBuffer(b"r", 8, 0, b"c", 3), 64, 10, b"e")
    assert _decoder.decode(_encoder.encode(ref)) == ref


def _fields(ref: DirectRef) -> dict[str, object]:
    return {name: getattr(ref, name) for name in ref.__struct_fields__}
