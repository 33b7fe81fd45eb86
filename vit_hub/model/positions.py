"""Fixed 2-D sine-cosine position embeddings, in NumPy: the one definition the model
(vit_hub/model/vit.py, which turns them into a tensor) and the torch-free analyses (vit_hub/insight/views.py,
run beside the ONNX backend without torch) both read.

A patch at row y and column x of the grid gets four blocks of dim/4 channels,
sin(y w), cos(y w), sin(x w), cos(x w), with frequencies w = 1 / 10000^(k / (dim/4)),
k = 0 .. dim/4 - 1: nearby patches get similar vectors, and every patch a different one.
"""

from __future__ import annotations

import numpy as np


def sincos_positions(grid_h: int, grid_w: int, dim: int) -> np.ndarray:
    """float32 [grid_h * grid_w, dim]: row n is the position of patch n, patches in row-major
    order (n = y * grid_w + x), channels [sin(y w) | cos(y w) | sin(x w) | cos(x w)]."""
    if dim % 4:
        raise ValueError(f"sincos positions need embed_dim divisible by 4, got {dim}")
    quarter = dim // 4
    frequencies = 1.0 / 10000 ** (np.arange(quarter, dtype=np.float32) / quarter)  # [dim/4]
    ys, xs = np.meshgrid(np.arange(grid_h, dtype=np.float32), np.arange(grid_w, dtype=np.float32), indexing="ij")
    y_angles = ys.reshape(-1, 1) * frequencies  # [N, dim/4]
    x_angles = xs.reshape(-1, 1) * frequencies
    blocks = [np.sin(y_angles), np.cos(y_angles), np.sin(x_angles), np.cos(x_angles)]
    return np.concatenate(blocks, axis=1).astype(np.float32)  # [N, dim]
