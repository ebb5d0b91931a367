"""bench_extend's choice of kernel: this tree's, or another revision's file (`--kernel-file`) for an A/B."""

from __future__ import annotations

from pathlib import Path

from radixmesh.kernels import extend_attention
from radixmesh.kernels.bench_extend import load_kernel, parse_args


def test_default_kernel_is_this_trees_and_reads_rows() -> None:
    fwd, label, reads_rows = load_kernel(parse_args([]).kernel_file)
    assert fwd is extend_attention.extend_attention_fwd and label == "triton" and reads_rows


def test_kernel_file_loads_that_file_and_sees_whether_it_reads_rows(tmp_path: Path) -> None:
    old = tmp_path / "extend_attention.py"
    old.write_text("def extend_attention_fwd(q, k_buffer, v_buffer, out, qo_indptr, kv_indptr, kv_indices,\n"
                   "                         max_extend_len, sm_scale, blocks=None, heavy_first=True):\n"
                   "    return 'previous'\n")
    fwd, label, reads_rows = load_kernel(parse_args(["--kernel-file", str(old)]).kernel_file)
    assert fwd(*range(9)) == "previous" and label == f"triton:{old}" and not reads_rows
