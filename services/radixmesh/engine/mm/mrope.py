"""Multimodal rotary positions (M-RoPE, Qwen2-VL): three position ids per token (time, height, width).

Text tokens carry the same id three times, counting up as usual. An image's tokens (its merged patch
grid, row by row) start at the next id: time = start, height = start + row, width = start + column;
the text after it continues at start + max(rows, columns). So a prompt with images needs fewer ids
than tokens: generated token i (counted from the prompt's start) sits at i + delta, delta <= 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from radixmesh.wire.images import ImageInput


def mrope_positions(prompt_len: int, images: Sequence[ImageInput], merge_size: int) -> tuple[np.ndarray, int]:
    """The prompt's positions `[3, prompt_len]` int64, and the delta of the tokens after it."""
    positions = np.empty((3, prompt_len), dtype=np.int64)
    next_id = index = 0
    for image in images:
        assert image.grid_thw is not None, "an M-RoPE model's image without a patch grid"
        text_len = image.offset - index
        positions[:, index:image.offset] = next_id + np.arange(text_len)
        next_id += text_len
        t, h, w = image.grid_thw
        rows, cols = h // merge_size, w // merge_size
        assert t * rows * cols == image.num_tokens, (
            f"image grid {image.grid_thw} (merge {merge_size}) has {t * rows * cols} tokens, not {image.num_tokens}")
        grid_t, grid_r, grid_c = np.meshgrid(np.arange(t), np.arange(rows), np.arange(cols), indexing="ij")
        positions[0, image.offset:image.end] = next_id + grid_t.reshape(-1)
        positions[1, image.offset:image.end] = next_id + grid_r.reshape(-1)
        positions[2, image.offset:image.end] = next_id + grid_c.reshape(-1)
        next_id += max(rows, cols)
        index = image.end
    positions[:, index:] = next_id + np.arange(prompt_len - index)
    next_id += prompt_len - index
    return positions, next_id - prompt_len
