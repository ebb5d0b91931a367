"""LoRA slot buffers on CPU: which projections get buffers, where an adapter's slices land (whole and as a
tensor-parallel shard), clearing and rewriting a slot; LoraRuntime's per-row slot choice and its mirror."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from radixmesh.engine.distributed.layout import ShardLayout
from radixmesh.engine.lora.adapter import LoraAdapter
from radixmesh.engine.lora.runtime import LoraRuntime
from radixmesh.engine.lora.slots import LoraSlots, SlotShape

from .test_lora_adapter import CONFIG  # hidden 64, 8 heads of 8, 2 KV heads, MLP 128, 2 layers

CPU = torch.device("cpu")
HIDDEN, Q, KV, INTER = 64, 64, 16, 128


class Part(nn.Module):
    """Stands for a layer's attention or MLP: holds the (stacked) projections LoRA attaches to."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        for name in names:
            setattr(self, name, nn.Identity())


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Part("qkv_proj", "o_proj")
        self.mlp = Part("gate_up_proj", "down_proj")


class TinyDecoder(nn.Module):
    def __init__(self, num_layers: int = 2) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Layer() for _ in range(num_layers))


def make_adapter(name: str, rank: int, modules: dict[str, tuple[int, int]], seed: int = 0,
                 scaling: float = 0.5, layers: int = 2) -> LoraAdapter:
    """Random A [r, in] and B [out, r] for each (module -> (in, out)) of every layer."""
    gen = torch.Generator().manual_seed(seed)
    weights = {(layer, m): (torch.randn(rank, i, generator=gen), torch.randn(o, rank, generator=gen))
               for layer in range(layers) for m, (i, o) in modules.items()}
    return LoraAdapter(name, f"/adapters/{name}", rank, scaling, tuple(modules), weights)


def make_slots(targets: tuple[str, ...], num_slots: int = 2, max_rank: int = 8, rank: int = 0,
               size: int = 1) -> tuple[TinyDecoder, LoraSlots]:
    model = TinyDecoder()
    slots = LoraSlots(model, ShardLayout.of(CONFIG, rank, size), HIDDEN, SlotShape(num_slots, max_rank, targets),
                      CPU, torch.float32)
    return model, slots


def test_only_targeted_projections_get_buffers_and_are_attached() -> None:
    model, slots = make_slots(("q_proj", "v_proj"))
    assert sorted(slots.projections) == [(0, "qkv_proj"), (1, "qkv_proj")]
    proj = slots.projections[(0, "qkv_proj")]
    assert proj.a.shape == (2, 3 * 8, HIDDEN) and proj.b.shape == (2, Q + 2 * KV, 8)
    assert proj.slice_sizes == (Q, KV, KV)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.lora is proj and not hasattr(layer.mlp.down_proj, "lora")
    assert slots.num_bytes == 2 * 4 * (proj.a.numel() + proj.b.numel())


def test_mlp_buffers_have_the_mlp_shapes() -> None:
    _, slots = make_slots(("up_proj", "down_proj"), num_slots=3, max_rank=4)
    gate_up, down = slots.projections[(1, "gate_up_proj")], slots.projections[(1, "down_proj")]
    assert gate_up.a.shape == (3, 2 * 4, HIDDEN) and gate_up.b.shape == (3, 2 * INTER, 4)
    assert down.a.shape == (3, 4, INTER) and down.b.shape == (3, HIDDEN, 4)


def test_write_places_each_slice_and_leaves_the_others_zero() -> None:
    _, slots = make_slots(("q_proj", "k_proj", "v_proj"), max_rank=8)
    adapter = make_adapter("a", 4, {"q_proj": (HIDDEN, Q), "v_proj": (HIDDEN, KV)})
    slots.write(1, adapter)
    proj = slots.projections[(1, "qkv_proj")]
    a_q, b_q = adapter.weights[(1, "q_proj")]
    a_v, b_v = adapter.weights[(1, "v_proj")]
    assert torch.equal(proj.a[1, 0:4], a_q) and torch.equal(proj.a[1, 16:20], a_v)
    assert not proj.a[1, 4:16].any() and not proj.a[1, 20:].any()  # unused rank rows and the k slice
    assert torch.equal(proj.b[1, :Q, :4], b_q) and torch.equal(proj.b[1, Q + KV:, :4], b_v)
    assert not proj.b[1, Q:Q + KV].any() and not proj.b[1, :, 4:].any()
    assert not proj.a[0].any() and not proj.b[0].any()  # the other slot untouched
    assert slots.state.ranks.tolist() == [0, 4] and slots.state.ranks_host == [0, 4]
    assert slots.state.scalings_host == [0.0, 0.5] and slots.state.scalings[1].item() == 0.5


def test_rewriting_a_slot_drops_the_previous_adapter() -> None:
    _, slots = make_slots(("q_proj", "v_proj"), max_rank=8)
    slots.write(0, make_adapter("big", 8, {"q_proj": (HIDDEN, Q), "v_proj": (HIDDEN, KV)}))
    small = make_adapter("small", 2, {"q_proj": (HIDDEN, Q)}, seed=1, scaling=2.0)
    slots.write(0, small)
    proj = slots.projections[(0, "qkv_proj")]
    assert torch.equal(proj.a[0, :2], small.weights[(0, "q_proj")][0])
    assert not proj.a[0, 2:].any() and not proj.b[0, Q:].any() and not proj.b[0, :, 2:].any()
    assert slots.state.ranks_host[0] == 2 and slots.state.scalings_host[0] == 2.0
    slots.clear(0)
    assert slots.state.ranks_host[0] == 0 and slots.state.ranks[0].item() == 0


def test_tensor_parallel_shard_cuts_b_rows_of_column_and_a_columns_of_row_parallel() -> None:
    _, slots = make_slots(("q_proj", "o_proj"), rank=1, size=2)
    qkv, o = slots.projections[(0, "qkv_proj")], slots.projections[(0, "o_proj")]
    assert qkv.b.shape[1] == Q // 2 + 2 * (KV // 2) and o.a.shape[2] == Q // 2
    adapter = make_adapter("tp", 4, {"q_proj": (HIDDEN, Q), "o_proj": (Q, HIDDEN)})
    slots.write(0, adapter)
    a_q, b_q = adapter.weights[(0, "q_proj")]
    a_o, b_o = adapter.weights[(0, "o_proj")]
    assert torch.equal(qkv.a[0, :4], a_q)  # A of a column-parallel projection is whole
    assert torch.equal(qkv.b[0, :Q // 2, :4], b_q[Q // 2:])  # rank 1 holds the second half of the heads
    assert torch.equal(o.a[0, :4], a_o[:, Q // 2:]) and torch.equal(o.b[0, :, :4], b_o)


def test_targets_of_names_what_has_no_buffers() -> None:
    _, slots = make_slots(("q_proj", "v_proj"))
    adapter = make_adapter("x", 2, {"q_proj": (HIDDEN, Q), "down_proj": (INTER, HIDDEN)})
    assert slots.targets_of(adapter) == ["down_proj"]


# ---- LoraRuntime ------------------------------------------------------------------------------------------
def make_runtime(max_graph_bs: int = 4) -> LoraRuntime:
    return LoraRuntime(TinyDecoder(), ShardLayout.of(CONFIG), HIDDEN, SlotShape(2, 8, ("q_proj", "v_proj")), CPU,
                       torch.float32, max_graph_bs)


def test_runtime_rows_without_adapters_are_inactive() -> None:
    runtime = make_runtime()
    runtime.prepare_rows([-1, -1], None)
    assert not runtime.state.active


def test_runtime_decode_and_prefill_rows_become_runs() -> None:
    runtime = make_runtime()
    runtime.prepare_rows([1, 1, -1, 0], None)  # decode: one row per request
    assert runtime.state.active and runtime.state.runs == [(1, 0, 2), (0, 3, 4)]
    runtime.prepare_rows([0, -1, 1], [2, 3, 1])  # prefill: each request's extend rows
    assert runtime.state.runs == [(0, 0, 2), (1, 5, 6)]


def test_runtime_projection_adds_each_rows_adapter_output() -> None:
    runtime = make_runtime()
    adapter = make_adapter("a", 4, {"q_proj": (HIDDEN, Q), "v_proj": (HIDDEN, KV)}, scaling=0.25)
    runtime.write(1, adapter)
    runtime.prepare_rows([1, -1, 1], [2, 1, 1])  # rows 0-1 and 3 use slot 1, row 2 the base model
    proj = runtime.slots.projections[(0, "qkv_proj")]
    x = torch.randn(4, HIDDEN)
    y = proj.add(x, torch.zeros(4, Q + 2 * KV))
    a_q, b_q = adapter.weights[(0, "q_proj")]
    a_v, b_v = adapter.weights[(0, "v_proj")]
    for row in (0, 1, 3):
        torch.testing.assert_close(y[row, :Q], 0.25 * (x[row] @ a_q.t() @ b_q.t()))
        torch.testing.assert_close(y[row, Q + KV:], 0.25 * (x[row] @ a_v.t() @ b_v.t()))
        assert not y[row, Q:Q + KV].any()
    assert not y[2].any()


def test_runtime_mirrors_writes_and_clears_to_the_other_ranks() -> None:
    runtime = make_runtime()
    calls: list[tuple[int, str, str | None]] = []
    runtime.mirror = lambda slot, name, path: calls.append((slot, name, path))
    runtime.write(0, make_adapter("sql", 2, {"q_proj": (HIDDEN, Q)}))
    runtime.clear(0)
    assert calls == [(0, "sql", "/adapters/sql"), (0, "", None)]
    assert runtime.state.ranks_host == [0, 0]


@pytest.mark.parametrize("padded_bs", [3, 4])
def test_stage_graph_pads_rows_with_no_adapter(padded_bs: int) -> None:
    runtime = make_runtime(max_graph_bs=4)
    assert runtime.graph_slots.tolist() == [-1] * 4
    runtime.stage_graph([1, 0], padded_bs)
    assert runtime.graph_slots[:padded_bs].tolist() == [1, 0] + [-1] * (padded_bs - 2)


def test_bind_graph_captures_with_or_without_the_adapters() -> None:
    runtime = make_runtime(max_graph_bs=4)
    runtime.bind_graph(4, with_lora=False)
    assert not runtime.state.active and runtime.state.kernel_batch is None
    runtime.bind_graph(2)
    assert runtime.state.active and runtime.state.kernel_batch.slots.data_ptr() == runtime.graph_slots.data_ptr()
    assert runtime.state.kernel_batch.num_segments == 2


def test_a_replay_takes_the_graph_without_lora_when_no_row_uses_an_adapter() -> None:
    from types import SimpleNamespace

    from radixmesh.engine.cuda_graph_runner import CudaGraphRunner

    graphs = CudaGraphRunner.__new__(CudaGraphRunner)  # no CUDA: only the variant choice
    graphs.runner = SimpleNamespace(lora=make_runtime(max_graph_bs=4))

    def batch(*slots: int) -> SimpleNamespace:
        return SimpleNamespace(reqs=[SimpleNamespace(lora_slot=s) for s in slots])

    assert not graphs._stage_lora(batch(-1, -1), 4)
    assert graphs.runner.lora.graph_slots.tolist() == [-1] * 4  # nothing staged
    assert graphs._stage_lora(batch(-1, 1, -1), 4)
    assert graphs.runner.lora.graph_slots.tolist() == [-1, 1, -1, -1]
    graphs.runner = SimpleNamespace(lora=None)
    assert not graphs._stage_lora(batch(-1), 1)


def test_a_linear_layer_runs_as_without_lora_in_a_pass_of_base_rows() -> None:
    from radixmesh.engine.models.layers import Linear

    runtime = make_runtime()
    layer = Linear(HIDDEN, Q + 2 * KV, bias=False)
    layer.lora = runtime.slots.projections[(0, "qkv_proj")]
    runtime.write(0, make_adapter("a", 4, {"q_proj": (HIDDEN, Q), "v_proj": (HIDDEN, KV)}))
    x = torch.randn(2, HIDDEN)
    runtime.prepare_rows([-1, -1], None)
    assert not layer.lora.active
    torch.testing.assert_close(layer(x), x @ layer.weight.t())
    runtime.prepare_rows([0, -1], None)
    assert layer.lora.active
    out = layer(x)
    torch.testing.assert_close(out[1], x[1] @ layer.weight.t())
    assert not torch.allclose(out[0], x[0] @ layer.weight.t())
