"""NIXL descriptor lists of a KV transfer: runs of contiguous rows, on both sides at once.

A transfer moves T tokens' K and V of L layers: 2L row sets. Each side keeps them either in its pool (one
buffer per layer and K/V, a token's row at `base + slot * row_bytes`) or packed in a staging region
(`[L, 2, T, heads, head_dim]`, row t of set b at `region + (b * T + t) * row_bytes`). A `RowSpace` says
which: per row set its base address and registered buffer, and per token its row index.

A READ pairs local and remote descriptors one to one, so a descriptor ends wherever either side's rows stop
being contiguous: the runs are "joint". Descriptors that continue one another on both sides inside the same
registered buffers are merged, so two packed regions make one descriptor for the whole transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.int64]


@dataclass(frozen=True)
class RowSpace:
    """Where one side holds the rows of a transfer."""

    bases: Array
    """[2L] address of row 0 of each row set (layer l's K is set 2l, its V 2l + 1)."""
    buffers: Array
    """[2L] which registered buffer each set lies in (descriptors merge only within one)."""
    rows: Array
    """[T] the row index of each token, in prompt order."""
    device_id: int
    """The GPU index NIXL is told (0 for host memory)."""


def pool_space(k_addrs: list[int], v_addrs: list[int], rows: Array, device_id: int) -> RowSpace:
    """Rows in a pool: `rows` are slots of the per-layer K and V buffers at those addresses."""
    bases = np.empty(2 * len(k_addrs), dtype=np.int64)
    bases[0::2], bases[1::2] = k_addrs, v_addrs
    return RowSpace(bases, np.arange(bases.shape[0], dtype=np.int64), rows.astype(np.int64), device_id)


def packed_space(address: int, num_layers: int, num_tokens: int, row_bytes: int, device_id: int) -> RowSpace:
    """Rows packed `[L, 2, T, ...]` from `address` (one registered buffer)."""
    bases = address + np.arange(2 * num_layers, dtype=np.int64) * num_tokens * row_bytes
    return RowSpace(bases, np.full(2 * num_layers, -1, dtype=np.int64), np.arange(num_tokens, dtype=np.int64),
                    device_id)


def run_starts(rows: Array) -> Array:
    """Indices where a run of consecutive rows begins (`rows[i] != rows[i - 1] + 1`), first one included."""
    if rows.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([[0], np.flatnonzero(np.diff(rows) != 1) + 1]).astype(np.int64)


def expand_runs(pairs: Array) -> Array:
    """The rows of `[n, 2]` (first row, length) runs, in order."""
    if pairs.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    firsts, lengths = pairs[:, 0], pairs[:, 1]
    offsets = np.cumsum(lengths) - lengths  # where each run starts in the output
    return (np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(firsts - offsets, lengths)).astype(np.int64)


def num_joint_runs(src_rows: Array, dst_rows: Array) -> int:
    """Runs contiguous on both sides (each costs 2L descriptors before merging)."""
    if src_rows.shape[0] == 0:
        return 0
    breaks = (np.diff(src_rows) != 1) | (np.diff(dst_rows) != 1)
    return 1 + int(np.count_nonzero(breaks))


def read_descriptors(local: RowSpace, remote: RowSpace, row_bytes: int) -> tuple[npt.NDArray[np.uint64],
                                                                                  npt.NDArray[np.uint64]]:
    """(local, remote) Nx3 descriptor arrays (address, bytes, device id) moving every row set of `remote` into
    `local`, merged where both sides continue."""
    num_tokens = local.rows.shape[0]
    assert remote.rows.shape[0] == num_tokens and local.bases.shape == remote.bases.shape, "mismatched row spaces"
    if num_tokens == 0:
        empty = np.zeros((0, 3), dtype=np.uint64)
        return empty, empty
    breaks = (np.diff(local.rows) != 1) | (np.diff(remote.rows) != 1)
    starts = np.concatenate([[0], np.flatnonzero(breaks) + 1])
    lengths = np.diff(np.concatenate([starts, [num_tokens]])) * row_bytes
    # [2L, R] per row set and run, flattened set-major (a set's runs, then the next set's)
    local_addr = (local.bases[:, None] + local.rows[starts][None, :] * row_bytes).ravel()
    remote_addr = (remote.bases[:, None] + remote.rows[starts][None, :] * row_bytes).ravel()
    nbytes = np.broadcast_to(lengths, (local.bases.shape[0], lengths.shape[0])).ravel()
    local_buf = np.repeat(local.buffers, starts.shape[0])
    remote_buf = np.repeat(remote.buffers, starts.shape[0])
    keep = np.ones(local_addr.shape[0], dtype=bool)  # a descriptor that does not continue the previous one
    keep[1:] = ~((local_addr[:-1] + nbytes[:-1] == local_addr[1:]) & (remote_addr[:-1] + nbytes[:-1] == remote_addr[1:])
                 & (local_buf[:-1] == local_buf[1:]) & (remote_buf[:-1] == remote_buf[1:]))
    first = np.flatnonzero(keep)
    merged = np.add.reduceat(nbytes, first)
    return (_descs(local_addr[first], merged, local.device_id), _descs(remote_addr[first], merged, remote.device_id))


def _descs(addresses: Array, nbytes: Array, device_id: int) -> npt.NDArray[np.uint64]:
    out = np.empty((addresses.shape[0], 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = addresses, nbytes, device_id
    return out
