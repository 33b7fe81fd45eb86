"""Attention rollout (Abnar & Zuidema, 2020) and heat-map overlays, on plain arrays.

Rollout asks how much of the class token's final representation flows from each input
patch when attention is followed through every layer. Per layer:

    fuse heads (mean / max / min)                  [L, B, heads, T, T] -> [L, B, T, T]
    drop the weakest `discard_ratio` of the patch-to-patch weights of each sample
    add the identity (the residual path), renormalise every row to sum to 1
then multiply the layers in order (A_L @ ... @ A_1), read the class token's row over
the patch tokens, reshape it to the patch grid and scale each map to [0, 1].

The math runs in NumPy whatever the input: torch tensors (on any device, with or
without grad) are converted first, so the torch model and ONNX Runtime outputs give the
same maps. Results are always NumPy float32 arrays.

Unlike the popular `vit-explain` code, this handles every batch item, non-square grids,
never discards the class token's entries and renormalises rows with `keepdims`.

The registry of explanation methods, and occlusion (logits only), are in
`vit_hub.explain.attribution`; the maps that need gradients (integrated gradients, gradient
rollout) in `vit_hub.explain.gradients`, run on the torch model by `vit_hub.explain.run`. A
choice a caller makes (head fusion, discard ratio, pooling, grid, colormap, alpha) outside what
is offered raises `UserError`; attentions of the wrong shape are a bug in the caller and raise
ValueError.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from matplotlib import colormaps
from PIL import Image

from vit_hub.errors import UserError
from vit_hub.model.config import POOLINGS, size_text

HEAD_FUSIONS = ("mean", "max", "min")
DEFAULT_HEAD_FUSION = "mean"  # what the app opens with, and the map inside pipeline_map.onnx
DEFAULT_DISCARD_RATIO = 0.0
DEFAULT_COLOURMAP = "jet"  # every map the app draws, and the colours pipeline_map.onnx gives
FLAT_SPREAD = 1e-5  # a map whose spread is at most this share of its largest value is flat


def as_numpy(array: Any) -> np.ndarray:
    """Torch tensor or array-like -> float32 NumPy array (detached, on the CPU). A tuple or
    list (the model's attentions: one [B, heads, T, T] tensor per block) is stacked."""
    if isinstance(array, (tuple, list)) and array and hasattr(array[0], "detach"):
        return np.stack([as_numpy(item) for item in array])
    if hasattr(array, "detach"):  # a torch tensor; avoids importing torch here
        array = array.detach().float().cpu().numpy()
    return np.asarray(array, dtype=np.float32)


def _check_attentions(attentions: np.ndarray) -> None:
    if attentions.ndim != 5 or attentions.shape[-1] != attentions.shape[-2]:
        raise ValueError(
            "expected attentions of shape [depth, batch, heads, tokens, tokens], "
            f"got shape {list(attentions.shape)}"
        )
    if attentions.shape[-1] < 2:
        raise ValueError(f"expected a class token and at least one patch token, got {attentions.shape[-1]} tokens")


def _grid(num_patches: int, grid_size: tuple[int, int] | None) -> tuple[int, int]:
    """The patch grid (height, width): given, or inferred when the number of patches is square."""
    if grid_size is None:
        side = math.isqrt(num_patches)
        if side * side != num_patches:
            raise UserError(f"{num_patches} patches do not form a square grid; pass grid_size=(height, width)")
        return side, side
    grid_h, grid_w = (int(size) for size in grid_size)
    if grid_h * grid_w != num_patches:
        raise UserError(f"grid_size {size_text((grid_h, grid_w))} does not match the {num_patches} patch tokens")
    return grid_h, grid_w


def _readout(joint: np.ndarray, pooling: str) -> np.ndarray:
    """[B, T, T] joint attention -> [B, N]: how much each patch feeds the pooled token(s),
    the class token's row ("cls") or the mean of the patch tokens' rows ("mean")."""
    if pooling == "cls":
        return joint[:, 0, 1:]
    if pooling == "mean":
        return joint[:, 1:, 1:].mean(axis=1)
    raise UserError(f"pooling: expected one of {', '.join(POOLINGS)}, got {pooling!r}")


def fuse_heads(attentions: np.ndarray, head_fusion: str) -> np.ndarray:
    """[..., heads, T, T] -> [..., T, T] by the mean, max or min over heads."""
    if head_fusion not in HEAD_FUSIONS:
        raise UserError(f"head_fusion: expected one of {', '.join(HEAD_FUSIONS)}, got {head_fusion!r}")
    return getattr(np, head_fusion)(attentions, axis=-3)


def discard_lowest(attention: np.ndarray, discard_ratio: float) -> np.ndarray:
    """Zero the lowest `discard_ratio` of the patch-to-patch weights of each [T, T] matrix.

    attention: [..., T, T]. Row 0 and column 0 (the class token's attention and the
    attention paid to it) are never discarded. A weight goes when it is below the weight
    ranked just above the discarded share, so tied weights share one fate and equal
    weights are all kept. Returns a copy; rows are not renormalised.
    """
    if not 0.0 <= discard_ratio < 1.0:
        raise UserError(f"discard_ratio: expected a value in [0, 1), got {discard_ratio}")
    result = np.array(attention, dtype=np.float32)
    patches = result[..., 1:, 1:]  # [..., N, N], a view into result
    flat = patches.reshape(*patches.shape[:-2], -1)  # [..., N*N]
    count = int(discard_ratio * flat.shape[-1])
    if count == 0:
        return result
    lowest_kept = np.partition(flat, count, axis=-1)[..., count, None, None]  # [..., 1, 1]
    result[..., 1:, 1:] = np.where(patches < lowest_kept, 0.0, patches)
    return result


def add_residual(attention: np.ndarray) -> np.ndarray:
    """[..., T, T] -> (attention + I) with every row renormalised to sum to 1."""
    mixed = attention + np.eye(attention.shape[-1], dtype=np.float32)
    return mixed / mixed.sum(axis=-1, keepdims=True)


def scale_maps(maps: np.ndarray) -> np.ndarray:
    """[..., h, w] -> each map min-max scaled to [0, 1].

    A map whose spread is at most FLAT_SPREAD of its largest value is float round-off around a
    constant: it becomes all zeros (no patch stands out) instead of amplified noise.
    """
    low = maps.min(axis=(-2, -1), keepdims=True)
    high = maps.max(axis=(-2, -1), keepdims=True)
    flat = (high - low) <= FLAT_SPREAD * np.abs(high)
    scaled = (maps - low) / np.where(flat, 1.0, high - low)
    return np.where(flat, 0.0, scaled).astype(np.float32)


def layer_rollouts(attentions: Any, head_fusion: str = DEFAULT_HEAD_FUSION,
                   discard_ratio: float = DEFAULT_DISCARD_RATIO, grid_size: tuple[int, int] | None = None,
                   pooling: str = "cls") -> np.ndarray:
    """Rollout through the first 1, 2, ..., depth layers: [depth, B, grid_h, grid_w] in [0, 1].

    The last entry is `attention_rollout`; the others show how the map builds up.
    """
    attentions = as_numpy(attentions)
    _check_attentions(attentions)
    depth, batch, _, tokens, _ = attentions.shape
    grid_h, grid_w = _grid(tokens - 1, grid_size)
    mixed = add_residual(discard_lowest(fuse_heads(attentions, head_fusion), discard_ratio))  # [L, B, T, T]

    joint = mixed[0]  # [B, T, T]: how layer 1's outputs draw on the input tokens
    readouts = [_readout(joint, pooling)]  # each [B, N]
    for layer in mixed[1:]:
        joint = layer @ joint
        readouts.append(_readout(joint, pooling))
    maps = np.stack(readouts).reshape(depth, batch, grid_h, grid_w)
    return scale_maps(maps)


def attention_rollout(attentions: Any, head_fusion: str = DEFAULT_HEAD_FUSION,
                      discard_ratio: float = DEFAULT_DISCARD_RATIO, grid_size: tuple[int, int] | None = None,
                      pooling: str = "cls") -> np.ndarray:
    """Attention rollout: [depth, B, heads, T, T] attentions -> [B, grid_h, grid_w] in [0, 1].

    Args:
        attentions: post-softmax attention weights of every layer, a torch tensor or a
            NumPy array (as `model(x, output_attentions=True)` or the ONNX graph return).
        head_fusion: "mean", "max" or "min" over the heads of a layer.
        discard_ratio: share of each layer's patch-to-patch weights to zero per sample
            (the weakest ones) before adding the residual; entries of the class token are kept.
        grid_size: (grid_h, grid_w) of the patch grid; needed when it is not square
            (e.g. `config.grid_size`).
        pooling: "cls" reads the class token's row (the default ViT head); "mean" averages
            the patch tokens' rows, for models that pool by the mean (`config.pooling`).

    Returns:
        NumPy float32 [B, grid_h, grid_w], each map scaled to [0, 1].
    """
    return layer_rollouts(attentions, head_fusion, discard_ratio, grid_size, pooling)[-1]


def last_layer_attention(attentions: Any, grid_size: tuple[int, int] | None = None,
                         pooling: str = "cls") -> np.ndarray:
    """The last layer's attention from the pooled token(s) to the patches, mean over heads:
    [depth, B, heads, T, T] -> [B, grid_h, grid_w] in [0, 1]. What the head reads directly,
    with none of the earlier layers' mixing followed (Dosovitskiy et al. 2021, Figure 6
    shows rollout instead)."""
    attentions = as_numpy(attentions)
    _check_attentions(attentions)
    _, batch, _, tokens, _ = attentions.shape
    grid_h, grid_w = _grid(tokens - 1, grid_size)
    return scale_maps(_readout(attentions[-1].mean(axis=1), pooling).reshape(batch, grid_h, grid_w))


def heatmap(mask: Any, size: tuple[int, int], colormap: str = DEFAULT_COLOURMAP) -> np.ndarray:
    """[h, w] mask in [0, 1] -> uint8 RGB heat map [height, width, 3] for size=(width, height),
    upsampled bilinearly and coloured through the colormap's 256-entry table."""
    mask = as_numpy(mask)
    if mask.ndim != 2:
        raise ValueError(f"expected a 2-D mask [grid_h, grid_w], got shape {list(mask.shape)}")
    upsampled = np.asarray(Image.fromarray(np.clip(mask, 0.0, 1.0)).resize(size, Image.Resampling.BILINEAR))
    return colour_table(colormap)[(upsampled * 255.0).round().astype(np.uint8)]  # [height, width, 3]


@functools.cache
def colour_table(colormap: str = DEFAULT_COLOURMAP) -> np.ndarray:
    """The matplotlib colormap's 256 colours as a read-only uint8 table [256, 3], built once:
    a map in [0, 1] is coloured by indexing it with round(255 * value)."""
    if colormap not in colormaps:
        raise UserError(f"unknown matplotlib colormap {colormap!r}")
    table = (colormaps[colormap](np.linspace(0.0, 1.0, 256))[:, :3] * 255.0).round().astype(np.uint8)
    table.flags.writeable = False
    return table


def overlay(image: Image.Image, mask: Any, alpha: float = 0.5, colormap: str = DEFAULT_COLOURMAP) -> Image.Image:
    """Blend a rollout mask over an image: RGB PIL image of the image's size.

    mask: [grid_h, grid_w] in [0, 1], upsampled bilinearly to the image size and coloured
    with a matplotlib colormap; alpha is the heat map's weight (0 = image only).
    """
    if not 0.0 <= alpha <= 1.0:
        raise UserError(f"alpha: expected a value in [0, 1], got {alpha}")
    heat = Image.fromarray(heatmap(mask, image.size, colormap))
    return Image.blend(image.convert("RGB"), heat, alpha)
