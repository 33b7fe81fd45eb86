"""What "nothing here" is for a model, and blanking patches with it: occlusion, the integrated
gradients methods (their path starts at the blank image) and the faithfulness benchmark all
blank patches the same way. Torch-free: the ONNX backend's occlusion uses it too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vit_hub.processing.preprocess import normalize


def blank_pixels(config: Any) -> np.ndarray:
    """The model-input value [C] of "nothing here": black paper, normalised as every input is,
    for a grayscale model; the normalised zero (the training set's mean colour, or the image's
    own with per-image normalisation) for a colour one. Occlusion, the integrated gradients
    methods and the faithfulness benchmark blank patches with it."""
    if config.in_channels == 1:
        return normalize(np.zeros((1, 1, 1), np.uint8), config)[:, 0, 0]  # one black pixel [C=1, 1, 1] -> [1]
    return np.zeros(config.in_channels, np.float32)


def patch_masks(grid_size: tuple[int, int], patch_size: tuple[int, int]) -> np.ndarray:
    """bool [N, H, W]: mask n covers patch n (row-major over the grid)."""
    grid_h, grid_w = grid_size
    eye = np.eye(grid_h * grid_w, dtype=bool).reshape(-1, grid_h, grid_w)
    return eye.repeat(patch_size[0], axis=1).repeat(patch_size[1], axis=2)


def blank_patches(pixels: np.ndarray, chosen: np.ndarray, patch_size: tuple[int, int],
                  blank: np.ndarray) -> np.ndarray:
    """pixels [B, C, H, W]; chosen bool [B, grid_h, grid_w] -> copy with the chosen patches blank."""
    per_pixel = chosen.repeat(patch_size[0], axis=1).repeat(patch_size[1], axis=2)[:, None]  # [B, 1, H, W]
    return np.where(per_pixel, blank[None, :, None, None], pixels).astype(np.float32)
