"""Which explanation methods there are, and the ones that need no torch: a map per image of
how much each patch supports the explained class, [B, grid_h, grid_w] scaled to [0, 1].

    name                  needs           what the map is
    rollout               attentions      attention followed through every layer (Abnar & Zuidema 2020)
    last_attention        attentions      the last layer's attention from the pooled token
    occlusion             logits          the fall in the class's log-probability when the patch
                                          alone is blanked (Zeiler & Fergus 2014)
    gradient_rollout      gradients       rollout weighted by d(class)/d(attention) (Chefer et al. 2021)
    attention_gradient    gradients       attention x its gradient, positive part, summed over layers
    last_attention_gradient gradients     the same, last layer only
    gradient_x_input      gradients       (image - blank image) x gradient, summed over each patch
    integrated_gradients  gradients       the same, the gradient averaged along the straight path
                                          from the blank image (Sundararajan et al. 2017), a few steps
    integrated_gradients_rollout  gradients  the patches integrated gradients credit first (by their
                                          share), then the rest by gradient rollout: the context
    gradient_x_embedding  gradients       as gradient_x_input, on the patch embeddings
    embedding_integrated_gradients  gradients  as integrated_gradients, on the patch embeddings

The first three run on any backend (the ONNX graphs give logits and attentions); the rest
are computed by `vit_hub.explain` from the torch model. "Blank" is `blank_pixels`: what the
model sees where there is nothing, black paper for a digit model and the training set's mean
colour for photos. The faithfulness of each (bench/faithfulness.py) is in BENCHMARKS.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .rollout import as_numpy, attention_rollout, last_layer_attention, scale_maps


@dataclass(frozen=True)
class Method:
    label: str  # as the app shows it
    needs: str  # "attentions", "logits" or "gradients" (the last: the torch model only)
    meaning: str  # what a bright patch means, in a phrase


METHODS: dict[str, Method] = {
    "rollout": Method("Attention rollout", "attentions",
                      "how much of the class token's attention, followed through every layer, comes from the patch"),
    "last_attention": Method("Last layer's attention", "attentions",
                             "how much the last layer's pooled token attends to the patch"),
    "occlusion": Method("Occlusion", "logits", "how far the class's log-probability falls when the patch alone is blanked"),
    "gradient_rollout": Method("Gradient rollout", "gradients",
                               "rollout of the attention weighted by its gradient for the class"),
    "attention_gradient": Method("Attention x gradient", "gradients",
                                 "attention to the patch times its gradient for the class, summed over the layers"),
    "last_attention_gradient": Method("Last attention x gradient", "gradients",
                                      "the last layer's attention to the patch times its gradient for the class"),
    "gradient_x_input": Method("Gradient x input", "gradients",
                               "the class score's gradient times how the patch differs from blank"),
    "integrated_gradients": Method("Integrated gradients", "gradients",
                                   "how much of the class score the patch adds, going from a blank image to this one"),
    "integrated_gradients_rollout": Method(
        "Integrated gradients + gradient rollout", "gradients",
        "integrated gradients where they credit the patch; below those, gradient rollout ranks the rest"),
    "gradient_x_embedding": Method("Gradient x embedding", "gradients",
                                   "gradient times input, on the patch embeddings"),
    "embedding_integrated_gradients": Method("Integrated gradients on the embeddings", "gradients",
                                             "integrated gradients on the patch embeddings"),
}


def check_method(method: str) -> Method:
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
    return METHODS[method]


def blank_pixels(config: Any) -> np.ndarray:
    """The model-input value [C] of "nothing here": pixel 0 (black) for a grayscale model, the
    normalised zero (the training set's mean colour, or the image's own with per-image
    normalisation) for a colour one. Occlusion, the embedding-gradient methods and the
    faithfulness benchmark blank patches with it."""
    if config.in_channels == 1 and config.pixel_norm == "dataset":
        return ((0.0 - np.asarray(config.mean, np.float32)) / np.asarray(config.std, np.float32)).astype(np.float32)
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


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def occlusion(logits_of: Callable[[np.ndarray], Any], pixels: np.ndarray, class_index: Any,
              grid_size: tuple[int, int], patch_size: tuple[int, int], blank: np.ndarray,
              chunk: int = 256) -> np.ndarray:
    """Occlusion: how far the class's log-probability falls when one patch is blanked.

    logits_of: float32 [n, C, H, W] -> logits [n, classes] (the torch model or an ONNX graph).
    pixels [B, C, H, W]; class_index int or [B]. One batch of B x N blanked images (in chunks
    of `chunk`). Returns [B, grid_h, grid_w] in [0, 1]; patches whose loss raises the class
    rank lowest.
    """
    pixels = as_numpy(pixels)
    batch = len(pixels)
    grid_h, grid_w = grid_size
    masks = patch_masks((grid_h, grid_w), patch_size)[:, None]  # [N, 1, H, W]
    blanked = np.where(masks[None], blank[None, None, :, None, None], pixels[:, None])  # [B, N, C, H, W]
    batch_all = np.concatenate([pixels, blanked.reshape(-1, *pixels.shape[1:])]).astype(np.float32)
    logits = np.concatenate([as_numpy(logits_of(batch_all[i:i + chunk])) for i in range(0, len(batch_all), chunk)])
    targets = np.broadcast_to(np.asarray(class_index).reshape(-1), (batch,))
    scores = log_softmax(logits)
    intact = scores[np.arange(batch), targets]  # [B]
    occluded = scores[batch:].reshape(batch, -1, scores.shape[-1])[np.arange(batch), :, targets]  # [B, N]
    return scale_maps((intact[:, None] - occluded).reshape(batch, grid_h, grid_w))


def attention_map(method: str, attentions: Any, config: Any) -> np.ndarray:
    """The maps of the methods that need attentions only: [B, grid_h, grid_w] in [0, 1]."""
    if method == "rollout":
        return attention_rollout(attentions, "mean", 0.0, config.grid_size, config.pooling)
    if method == "last_attention":
        return last_layer_attention(attentions, config.grid_size, config.pooling)
    raise ValueError(f"{method!r} is not a method of attentions alone (rollout, last_attention)")
