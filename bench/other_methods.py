"""Explanation methods kept for comparison only: bench/faithfulness.py measures them beside
vit_hub's own (`vit_hub.explain.attribution.METHODS`), the app does not offer them.

Each needs gradients, so the torch model, and each measured worse than integrated gradients +
gradient rollout (`integrated_gradients_rollout`) on every faithfulness benchmark: deletion and
insertion AUC and the drops at 10 % and 30 % of the patches, on the MNIST model and on the
distractor set (BENCHMARKS.md, "How faithful each method is"). That method fits the app's time
budget too, so none of these would be the better choice anywhere the app runs.

    gradient_rollout         rollout of the attention weighted by its gradient (Chefer et al. 2021);
                             still the context map inside integrated_gradients_rollout
    attention_gradient       attention x its gradient, positive part, summed over the layers
    last_attention_gradient  the same, last layer only (Chefer et al.'s last-layer baseline)
    gradient_x_input         (image - blank) x the gradient at the image, summed over each patch
    gradient_x_embedding     the same on the patch embeddings

    explain(model, pixels, OTHER_METHODS["gradient_rollout"])   # as for any vit_hub method
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vit_hub.explain.attribution import Method
from vit_hub.explain.gradients import (Explained, _check_gradients, attention_gradients, embedding_attributions,
                                       gradient_rollout, patch_grid, pixel_attributions)
from vit_hub.explain.rollout import _grid, _readout, as_numpy, scale_maps


def attention_gradient(attentions: Any, gradients: Any, grid_size: tuple[int, int] | None = None,
                       pooling: str = "cls", last_only: bool = False) -> np.ndarray:
    """Attention x gradient without following the layers: the positive part of A * dA, mean
    over heads, read from the pooled token's row and summed over the layers (or the last
    layer alone). attentions, gradients [depth, B, heads, T, T] -> [B, grid_h, grid_w] in [0, 1]."""
    attentions, gradients = as_numpy(attentions), as_numpy(gradients)
    _check_gradients(attentions, gradients)
    if last_only:
        attentions, gradients = attentions[-1:], gradients[-1:]
    _, batch, _, tokens, _ = attentions.shape
    grid_h, grid_w = _grid(tokens - 1, grid_size)
    weighted = np.clip(attentions * gradients, 0.0, None).mean(axis=2)  # [L, B, T, T]
    return scale_maps(sum(_readout(layer, pooling) for layer in weighted).reshape(batch, grid_h, grid_w))


# Compute functions, as vit_hub.explain.attribution.Method wants them for a method that needs gradients:
# (model, pixels [B, C, H, W], class_index, steps) -> Explained. None of these follows a path, so
# steps is unused.
def _gradient_rollout(model: Any, pixels: Any, class_index: Any, _steps: int) -> Explained:
    logits, attentions, gradients = attention_gradients(model, pixels, class_index)
    maps = gradient_rollout(attentions, gradients, model.config.grid_size, model.config.pooling)
    return Explained(as_numpy(logits), as_numpy(attentions), maps)


def _attention_gradient(last_only: bool):
    def compute(model: Any, pixels: Any, class_index: Any, _steps: int) -> Explained:
        logits, attentions, gradients = attention_gradients(model, pixels, class_index)
        maps = attention_gradient(attentions, gradients, model.config.grid_size, model.config.pooling, last_only)
        return Explained(as_numpy(logits), as_numpy(attentions), maps)
    return compute


def _gradient_x_input(model: Any, pixels: Any, class_index: Any, _steps: int) -> Explained:
    logits, attentions, attributions, _ = pixel_attributions(model, pixels, class_index, integrated=False)
    return Explained(as_numpy(logits), as_numpy(attentions), scale_maps(as_numpy(attributions)))


def _gradient_x_embedding(model: Any, pixels: Any, class_index: Any, _steps: int) -> Explained:
    logits, attentions, attributions = embedding_attributions(model, pixels, class_index, integrated=False)
    return Explained(as_numpy(logits), as_numpy(attentions), patch_grid(model, pixels, as_numpy(attributions)))


OTHER_METHODS: dict[str, Method] = {
    "gradient_rollout": Method(
        "Gradient rollout", "rollout of the attention weighted by its gradient for the class",
        _gradient_rollout, needs_gradients=True),
    "attention_gradient": Method(
        "Attention x gradient", "attention to the patch times its gradient for the class, summed over the layers",
        _attention_gradient(last_only=False), needs_gradients=True),
    "last_attention_gradient": Method(
        "Last attention x gradient", "the last layer's attention to the patch times its gradient for the class",
        _attention_gradient(last_only=True), needs_gradients=True),
    "gradient_x_input": Method(
        "Gradient x input", "the class score's gradient times how the patch differs from blank",
        _gradient_x_input, needs_gradients=True, needs_attentions=False),
    "gradient_x_embedding": Method(
        "Gradient x embedding", "gradient times input, on the patch embeddings",
        _gradient_x_embedding, needs_gradients=True, needs_attentions=False),
}
