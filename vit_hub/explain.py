"""Explanations that need the torch model: gradients of the class score with respect to the
attention weights or the patch embeddings. Every function returns maps [B, grid_h, grid_w]
scaled to [0, 1] (NumPy float32), higher where a patch supports the class more.

    explain(model, pixels, "integrated_gradients")      # any name in attribution.METHODS
    -> Explained(logits, attentions, maps)

The attention weights the model returns are in the autograd graph (model.py), so their
gradients are one `torch.autograd.grad` call. The embedding methods swap the output of
`model.patch_embedding` for points on the straight path from the blank image's embeddings
(`attribution.blank_pixels`) to the image's, and read the gradient there: one batched
forward and backward pass for all the steps. The torch-free maps (rollout, occlusion) are in
`vit_hub.rollout` and `vit_hub.attribution`; which method measures how faithful is in
BENCHMARKS.md ("Explanation faithfulness").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from .attribution import METHODS, attention_map, blank_pixels, check_method, occlusion
from .rollout import _check_attentions, _grid, _readout, as_numpy, scale_maps

INTEGRATED_GRADIENT_STEPS = 3  # midpoint rule; as faithful as 8 or 16 here at a third of the time (BENCHMARKS.md)


class Explained(NamedTuple):
    logits: np.ndarray  # [B, classes], of the intact images
    attentions: np.ndarray  # [depth, B, heads, T, T]
    maps: np.ndarray  # [B, grid_h, grid_w] in [0, 1]


def explain(model: Any, pixels: Any, method: str = "rollout", class_index: Any = None,
            steps: int = INTEGRATED_GRADIENT_STEPS) -> Explained:
    """Logits, attentions and the `method` map for pixels [B, C, H, W] (tensor or array).

    class_index: int or [B] ints, the class explained; the predicted one when None.
    steps: points on the path for the integrated gradients methods.
    """
    kind = check_method(method).needs
    config = model.config
    pixels = torch.as_tensor(pixels, dtype=torch.float32)
    if kind == "gradients":
        if method in ("gradient_x_input", "integrated_gradients", "integrated_gradients_rollout",
                      "gradient_x_embedding", "embedding_integrated_gradients"):
            logits, attentions, maps = _path_method(model, pixels, class_index, method, steps)
            return Explained(logits, attentions, maps)
        logits, attentions, gradients = attention_gradients(model, pixels, class_index)
        grid, pooling = config.grid_size, config.pooling
        if method == "gradient_rollout":
            maps = gradient_rollout(attentions, gradients, grid, pooling)
        else:
            maps = attention_gradient(attentions, gradients, grid, pooling, last_only=method.startswith("last"))
        return Explained(as_numpy(logits), as_numpy(attentions), maps)

    with torch.inference_mode():
        logits, attentions = model(pixels, output_attentions=True)
    logits, attentions = as_numpy(logits), as_numpy(attentions)
    if kind == "attentions":
        return Explained(logits, attentions, attention_map(method, attentions, config))
    targets = logits.argmax(-1) if class_index is None else class_index
    return Explained(logits, attentions, occlusion(torch_logits(model), pixels.numpy(), targets, config.grid_size,
                                                   tuple(config.patch_size), blank_pixels(config)))


def torch_logits(model: Any):
    """The model as `attribution.occlusion` wants it: float32 array -> logits array."""
    def logits_of(pixels: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(pixels)).logits.numpy()
    return logits_of


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


def attention_gradient(attentions: Any, gradients: Any, grid_size: tuple[int, int] | None = None,
                       pooling: str = "cls", last_only: bool = False) -> np.ndarray:
    """Attention x gradient without following the layers: the positive part of A * dA, mean
    over heads, read from the pooled token's row and summed over the layers (or the last
    layer alone, as in Chefer et al.'s last-layer baseline). [B, grid_h, grid_w] in [0, 1]."""
    attentions, gradients = as_numpy(attentions), as_numpy(gradients)
    _check_gradients(attentions, gradients)
    if last_only:
        attentions, gradients = attentions[-1:], gradients[-1:]
    _, batch, _, tokens, _ = attentions.shape
    grid_h, grid_w = _grid(tokens - 1, grid_size)
    weighted = np.clip(attentions * gradients, 0.0, None).mean(axis=2)  # [L, B, T, T]
    return scale_maps(sum(_readout(layer, pooling) for layer in weighted).reshape(batch, grid_h, grid_w))


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
        embeddings = model.patch_embedding(pixels)  # [B, N, D]
        start = model.patch_embedding(blank)  # [1, N, D]
    path = (start + alphas[:, None, None, None] * (embeddings - start)).reshape(-1, *embeddings.shape[1:])
    path.requires_grad_(True)  # [S * B, N, D]: step-major
    repeated = pixels.repeat(len(alphas), 1, 1, 1)
    # The hook swaps the output for this call's input only (the same tensor object reaches the
    # patch embedding): forward passes of other requests running meanwhile (the app serves
    # several at once) keep their own embeddings.
    handle = model.patch_embedding.register_forward_hook(
        lambda _module, inputs, _output: path if inputs[0] is repeated else None)
    try:
        with torch.enable_grad():
            logits = model(repeated).logits  # [S * B, classes]
            targets = _targets(intact, class_index).repeat(len(alphas), 1)
            (gradient,) = torch.autograd.grad(logits.gather(1, targets).sum(), path)
    finally:
        handle.remove()
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


CONTEXT_SHARE = 0.3  # the weight of gradient rollout beside integrated gradients' positive part (both in [0, 1])


def with_context(attributions: np.ndarray, context: np.ndarray) -> np.ndarray:
    """Integrated gradients' positive part, scaled to [0, 1], plus CONTEXT_SHARE x a context map
    (gradient rollout): the patches IG credits most come first in their order; the ones it gives
    little or negative credit are ranked by the context map, so what a class needs around its
    evidence (the rest of a digit's stroke, which IG along the path from black can score below
    zero) comes before empty background. On MNIST this lifts the insertion AUC from 0.72 to 0.82
    (BENCHMARKS.md); where attention points at distractors it costs deletion AUC."""
    positive = np.clip(attributions, 0.0, None)
    positive = positive / np.maximum(positive.max(axis=(-2, -1), keepdims=True), 1e-12)
    return scale_maps(positive + CONTEXT_SHARE * context)


def _path_method(model: Any, pixels: torch.Tensor, class_index: Any, method: str, steps: int):
    """The methods that read the class logit's gradient on the path from the blank image (or at the
    image alone), on the pixels or on the patch embeddings: (logits, attentions, maps) as arrays."""
    config = model.config
    if method in ("integrated_gradients", "gradient_x_input", "integrated_gradients_rollout"):
        logits, attentions, attributions, gradients = pixel_attributions(
            model, pixels, class_index, steps, integrated=method != "gradient_x_input")
        attributions = as_numpy(attributions)
        if method == "integrated_gradients_rollout":
            context = gradient_rollout(attentions, gradients, config.grid_size, config.pooling)
            return as_numpy(logits), as_numpy(attentions), with_context(attributions, context)
        return as_numpy(logits), as_numpy(attentions), scale_maps(attributions)
    logits, attentions, attributions = embedding_attributions(
        model, pixels, class_index, steps, integrated=method == "embedding_integrated_gradients")
    patch_h, patch_w = model.config.patch_size
    maps = scale_maps(as_numpy(attributions).reshape(len(pixels), pixels.shape[-2] // patch_h, -1))
    return as_numpy(logits), as_numpy(attentions), maps


__all__ = ["METHODS", "Explained", "attention_gradient", "attention_gradients", "embedding_attributions",
           "explain", "gradient_rollout", "pixel_attributions"]
