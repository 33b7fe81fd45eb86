"""The explanation maps that need the torch model: gradients of the class score with respect to
the attention weights, the pixels or the patch embeddings. Every map is [B, grid_h, grid_w]
scaled to [0, 1] (NumPy float32), higher where a patch supports the class more.

The attention weights the model returns are in the autograd graph (vit.py), so their
gradients are one `torch.autograd.grad` call. The embedding method runs the model from its
patch embeddings on (`VisionTransformer.forward_from_patches`), at points on the straight path
from the blank image's embeddings (`blanking.blank_pixels`) to the image's, and reads the
gradient there: one batched forward and backward pass for all the steps. The registry
(`vit_hub.explain.attribution.METHODS`) names the methods; `vit_hub.explain.run.explain` runs any of them.
Which measures how faithful is in BENCHMARKS.md ("How faithful each method is").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from vit_hub.explain.blanking import blank_pixels
from vit_hub.explain.rollout import _check_attentions, _grid, _readout, as_numpy, scale_maps

# Points on the integration path (midpoint rule). More steps cost one forward and backward pass
# of the batch each and measured no more faithful on the bundled models (BENCHMARKS.md).
INTEGRATED_GRADIENT_STEPS = 3


class Explained(NamedTuple):
    logits: np.ndarray  # [B, classes], of the intact images
    attentions: np.ndarray  # [depth, B, heads, T, T]
    maps: np.ndarray  # [B, grid_h, grid_w] in [0, 1]


def _targets(logits: torch.Tensor, class_index: Any) -> torch.Tensor:
    """[B, 1] class indices: the given ones (int or [B]) or the predicted ones."""
    if class_index is None:
        return logits.argmax(dim=-1, keepdim=True)
    return torch.as_tensor(class_index, device=logits.device).reshape(-1, 1).expand(logits.shape[0], 1)


def attention_gradients(model: Any, pixel_values: Any, class_index: Any = None):
    """(logits [B, classes], attentions, gradients): the attention weights of every block and
    the gradient of the class score (logit) with respect to them, both [depth, B, heads, T, T]
    tensors. class_index: int or [B] ints; the predicted class when None."""
    with torch.enable_grad():
        logits, attentions = model(torch.as_tensor(pixel_values), output_attentions=True)
        score = logits.gather(1, _targets(logits, class_index)).sum()
        gradients = torch.autograd.grad(score, attentions)
    return logits.detach(), torch.stack(attentions).detach(), torch.stack(gradients)


def _check_gradients(attentions: np.ndarray, gradients: np.ndarray) -> None:
    _check_attentions(attentions)
    if gradients.shape != attentions.shape:
        raise ValueError(f"expected gradients shaped like the attentions {list(attentions.shape)}, "
                         f"got {list(gradients.shape)}")


def gradient_rollout(attentions: Any, gradients: Any, grid_size: tuple[int, int] | None = None,
                     pooling: str = "cls") -> np.ndarray:
    """Class-specific rollout (Chefer et al., 2021, "Generic attention-model explainability").

    Each layer's attention is weighted by the gradient of the chosen class score with
    respect to it, negative contributions are dropped, heads are averaged, and the
    layers are combined as R <- R + A_bar @ R starting from R = I.

    attentions, gradients: [depth, B, heads, T, T]; grid_size and pooling as for
    `rollout.attention_rollout`. Returns [B, grid_h, grid_w] in [0, 1].
    """
    attentions, gradients = as_numpy(attentions), as_numpy(gradients)
    _check_gradients(attentions, gradients)
    _, batch, _, tokens, _ = attentions.shape
    grid_h, grid_w = _grid(tokens - 1, grid_size)
    weighted = np.clip(attentions * gradients, 0.0, None).mean(axis=2)  # [L, B, T, T]
    relevance = np.broadcast_to(np.eye(tokens, dtype=np.float32), (batch, tokens, tokens))
    for layer in weighted:
        relevance = relevance + layer @ relevance
    return scale_maps(_readout(relevance, pooling).reshape(batch, grid_h, grid_w))


def embedding_attributions(model: Any, pixel_values: Any, class_index: Any = None,
                           steps: int = INTEGRATED_GRADIENT_STEPS, integrated: bool = True):
    """(logits, attentions, attributions [B, N]) on the patch embeddings e, from the blank
    image's e0: sum over channels of (e - e0) * the mean gradient of the class logit at
    e0 + alpha (e - e0), alpha at the midpoints of `steps` equal parts of [0, 1] (integrated
    gradients), or at alpha = 1 alone (gradient x embedding). The attributions of a patch
    add up, over all patches, to about logit(image) - logit(blank) (completeness)."""
    config = model.config
    pixels = torch.as_tensor(pixel_values, dtype=torch.float32)
    batch = pixels.shape[0]
    blank = torch.from_numpy(blank_pixels(config))[None, :, None, None].expand(1, -1, *pixels.shape[2:])
    alphas = (torch.arange(steps, dtype=torch.float32) + 0.5) / steps if integrated else torch.ones(1)
    with torch.no_grad():
        intact, attentions = model(pixels, output_attentions=True)
        embeddings, grid = model.embed_patches(pixels)  # [B, N, D]
        start, _ = model.embed_patches(blank)  # [1, N, D]
    path = (start + alphas[:, None, None, None] * (embeddings - start)).reshape(-1, *embeddings.shape[1:])
    path.requires_grad_(True)  # [S * B, N, D]: step-major
    with torch.enable_grad():
        logits = model.forward_from_patches(path, grid).logits  # [S * B, classes]
        targets = _targets(intact, class_index).repeat(len(alphas), 1)
        (gradient,) = torch.autograd.grad(logits.gather(1, targets).sum(), path)
    mean_gradient = gradient.reshape(len(alphas), batch, *embeddings.shape[1:]).mean(0)  # [B, N, D]
    attributions = ((embeddings - start) * mean_gradient).sum(-1)  # [B, N]
    return intact, torch.stack(attentions), attributions


def pixel_attributions(model: Any, pixel_values: Any, class_index: Any = None,
                       steps: int = INTEGRATED_GRADIENT_STEPS, integrated: bool = True):
    """(logits, attentions, attributions [B, grid_h, grid_w], attention gradients) on the input
    pixels x, from the blank image x0: (x - x0) * the mean gradient of the class logit along the
    straight path (midpoints of `steps` parts; alpha = 1 alone for gradient x input), summed over
    each patch's pixels and channels: the patches the faithfulness benchmark blanks.

    One forward and backward pass serves the images and their paths together: the images' rows
    give the logits (which pick the class), the attentions and the class logit's gradient with
    respect to them ([depth, B, heads, T, T], for gradient rollout); the paths' rows give the
    pixel gradients. Rows of a batch never mix, so each gradient is the one asked for."""
    config = model.config
    pixels = torch.as_tensor(pixel_values, dtype=torch.float32)
    batch = pixels.shape[0]
    blank = torch.from_numpy(blank_pixels(config))[None, :, None, None]
    alphas = (torch.arange(steps, dtype=torch.float32) + 0.5) / steps if integrated else torch.ones(1)
    path = (blank + alphas[:, None, None, None, None] * (pixels - blank)).reshape(-1, *pixels.shape[1:])
    path.requires_grad_(True)  # [S * B, C, H, W]: step-major
    with torch.enable_grad():
        logits, attentions = model(torch.cat([pixels, path]), output_attentions=True)  # [(1 + S) * B, ...]
        targets = _targets(logits[:batch], class_index).repeat(1 + len(alphas), 1)
        gradient, *attention_gradients = torch.autograd.grad(logits.gather(1, targets).sum(), (path, *attentions))
    mean_gradient = gradient.reshape(len(alphas), *pixels.shape).mean(0)  # [B, C, H, W]
    per_pixel = ((pixels - blank) * mean_gradient).sum(1)  # [B, H, W]
    patch_h, patch_w = config.patch_size
    grid_h, grid_w = pixels.shape[-2] // patch_h, pixels.shape[-1] // patch_w
    attributions = per_pixel.reshape(batch, grid_h, patch_h, grid_w, patch_w).sum((2, 4))
    return (logits[:batch].detach(), torch.stack([layer[:batch] for layer in attentions]).detach(),
            attributions.detach(), torch.stack([layer[:batch] for layer in attention_gradients]))


# The weight of gradient rollout beside integrated gradients' positive part (both in [0, 1]): enough
# to order the patches integrated gradients leaves at zero, too little to reorder the ones it credits.
CONTEXT_SHARE = 0.3


def with_context(attributions: np.ndarray, context: np.ndarray) -> np.ndarray:
    """Integrated gradients' positive part, scaled to [0, 1], plus CONTEXT_SHARE x a context map
    (gradient rollout): the patches integrated gradients credit most come first, in their order;
    the ones it gives little or negative credit are ranked by the context map. Integrated
    gradients along the path from a black image can score part of a digit's stroke below zero,
    so alone it ranks that ink after empty background, and inserting patches in its order
    completes the digit last; the context map puts what a class needs around its evidence
    before the background. Where attention points at distractors, the context ranks them
    early too: that costs deletion AUC (BENCHMARKS.md)."""
    positive = np.clip(attributions, 0.0, None)
    positive = positive / np.maximum(positive.max(axis=(-2, -1), keepdims=True), 1e-12)
    return scale_maps(positive + CONTEXT_SHARE * context)


# The compute functions of the registry's methods that need gradients (attribution.METHODS):
# (model, pixels [B, C, H, W], class_index, steps) -> Explained.
def integrated_gradients(model: Any, pixels: Any, class_index: Any = None,
                         steps: int = INTEGRATED_GRADIENT_STEPS) -> Explained:
    """Integrated gradients on the pixels, summed over each patch (`pixel_attributions`)."""
    logits, attentions, attributions, _ = pixel_attributions(model, pixels, class_index, steps)
    return Explained(as_numpy(logits), as_numpy(attentions), scale_maps(as_numpy(attributions)))


def integrated_gradients_rollout(model: Any, pixels: Any, class_index: Any = None,
                                 steps: int = INTEGRATED_GRADIENT_STEPS) -> Explained:
    """Integrated gradients first, gradient rollout for the rest (`with_context`), from the one
    forward and backward pass `pixel_attributions` makes."""
    config = model.config
    logits, attentions, attributions, gradients = pixel_attributions(model, pixels, class_index, steps)
    context = gradient_rollout(attentions, gradients, config.grid_size, config.pooling)
    return Explained(as_numpy(logits), as_numpy(attentions), with_context(as_numpy(attributions), context))


def embedding_integrated_gradients(model: Any, pixels: Any, class_index: Any = None,
                                   steps: int = INTEGRATED_GRADIENT_STEPS) -> Explained:
    """Integrated gradients on the patch embeddings, one value per patch (`embedding_attributions`)."""
    logits, attentions, attributions = embedding_attributions(model, pixels, class_index, steps)
    return Explained(as_numpy(logits), as_numpy(attentions), patch_grid(model, pixels, as_numpy(attributions)))


def patch_grid(model: Any, pixels: Any, per_patch: np.ndarray) -> np.ndarray:
    """[B, N] values, one per patch -> maps [B, grid_h, grid_w] in [0, 1], on the pixels' grid."""
    patch_h, patch_w = model.config.patch_size
    return scale_maps(per_patch.reshape(len(pixels), pixels.shape[-2] // patch_h, pixels.shape[-1] // patch_w))


__all__ = ["Explained", "attention_gradients", "embedding_attributions", "embedding_integrated_gradients",
           "gradient_rollout", "integrated_gradients", "integrated_gradients_rollout", "pixel_attributions",
           "with_context"]
