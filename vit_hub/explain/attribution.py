"""The registry of explanation methods, and the ones that need no torch: a map per image of how
much each patch supports the explained class, [B, grid_h, grid_w] scaled to [0, 1].

    name                            needs                  what the map is
    rollout                         attentions             attention followed through every layer
                                                           (Abnar & Zuidema 2020)
    last_attention                  attentions             the last layer's attention from the pooled token
    occlusion                       logits                 the fall in the class's log-probability when the
                                                           patch alone is blanked (Zeiler & Fergus 2014)
    integrated_gradients            gradients              (image - blank) x the gradient averaged along the
                                                           straight path from the blank image, summed over
                                                           each patch (Sundararajan et al. 2017)
    integrated_gradients_rollout    gradients, attentions  the patches integrated gradients credits first
                                                           (by their share), then the rest by gradient
                                                           rollout (Chefer et al. 2021): the context
    embedding_integrated_gradients  gradients              integrated gradients on the patch embeddings

Each `Method` holds its compute function and says what it needs, so a backend asks the method,
never its name: the ONNX graphs give logits and attentions but no gradients. The methods that
need gradients are computed from the torch model in `vit_hub.explain.gradients`, imported only when one
runs, so this registry stays torch-free; `vit_hub.explain.run.explain` runs any of them on the torch
model. "Blank" is `blanking.blank_pixels`: what the model sees where there is nothing, black
paper for a digit model and the training set's mean colour for photos.

Every method here measures better than every other method on at least one of the faithfulness
benchmarks (BENCHMARKS.md, "How faithful each method is"); the methods measured worse than one of
these on all of them are compared in bench/other_methods.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from vit_hub.errors import UserError
from vit_hub.explain.blanking import blank_pixels, patch_masks
from vit_hub.explain.rollout import as_numpy, attention_rollout, last_layer_attention, scale_maps


class Forward(NamedTuple):
    """One forward pass of a batch: what the methods that need no gradients read."""

    pixels: np.ndarray  # [B, C, H, W], the model's input
    logits: np.ndarray  # [B, classes]
    attentions: np.ndarray | None  # [depth, B, heads, T, T]; None from a graph that gives none
    logits_of: Callable[[np.ndarray], Any]  # the model again: float32 [n, C, H, W] -> logits [n, classes]


@dataclass(frozen=True)
class Method:
    """An explanation method: how the app shows it, what it needs, and how it is computed.

    compute, for a method that needs no gradients: (forward: Forward, targets: int array [B],
    config) -> maps [B, grid_h, grid_w] in [0, 1]. For one that needs gradients: (torch model,
    pixels: float32 tensor [B, C, H, W], class_index: int, [B] ints or None for the predicted
    class, steps: points on an integration path) -> `gradients.Explained`.
    """

    label: str  # as the app shows it
    meaning: str  # what a bright patch means, in a phrase
    compute: Callable[..., Any]
    needs_gradients: bool = False  # the torch model only: an ONNX graph gives no gradients
    needs_attentions: bool = True  # reads attention weights: a graph must output them
    quick: bool = True  # a forward (and backward) pass or two, not one per patch: fits the app's time budget

    @property
    def runs_on_onnx(self) -> bool:
        """Computable from ONNX Runtime's outputs (logits, attentions) alone."""
        return not self.needs_gradients


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


# Images per forward pass of occlusion: the largest batch the app and the CLI run a model at
# (export/graph_check.py checks every graph at it).
OCCLUSION_CHUNK = 256


def occlusion(logits_of: Callable[[np.ndarray], Any], pixels: np.ndarray, class_index: Any,
              grid_size: tuple[int, int], patch_size: tuple[int, int], blank: np.ndarray,
              chunk: int = OCCLUSION_CHUNK) -> np.ndarray:
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


# The compute functions of the methods that need no gradients: (forward, targets, config) -> maps.
def _rollout(forward: Forward, _targets: np.ndarray, config: Any) -> np.ndarray:
    return attention_rollout(forward.attentions, "mean", 0.0, config.grid_size, config.pooling)


def _last_attention(forward: Forward, _targets: np.ndarray, config: Any) -> np.ndarray:
    return last_layer_attention(forward.attentions, config.grid_size, config.pooling)


def _occlusion(forward: Forward, targets: np.ndarray, config: Any) -> np.ndarray:
    return occlusion(forward.logits_of, forward.pixels, targets, config.grid_size, tuple(config.patch_size),
                     blank_pixels(config))


def _torch_side(name: str) -> Callable[..., Any]:
    """`vit_hub.explain.gradients.<name>`, imported on the first call: reading the registry needs no torch."""
    def compute(*args: Any, **kwargs: Any) -> Any:
        from vit_hub.explain import gradients

        return getattr(gradients, name)(*args, **kwargs)
    compute.__name__ = compute.__qualname__ = name
    return compute


METHODS: dict[str, Method] = {
    "rollout": Method(
        "Attention rollout",
        "how much of the class token's attention, followed through every layer, comes from the patch",
        _rollout),
    "last_attention": Method(
        "Last layer's attention", "how much the last layer's pooled token attends to the patch", _last_attention),
    # One forward pass per patch: slower than the app's budget for the map it opens with.
    "occlusion": Method(
        "Occlusion", "how far the class's log-probability falls when the patch alone is blanked", _occlusion,
        needs_attentions=False, quick=False),
    "integrated_gradients": Method(
        "Integrated gradients", "how much of the class score the patch adds, going from a blank image to this one",
        _torch_side("integrated_gradients"), needs_gradients=True, needs_attentions=False),
    "integrated_gradients_rollout": Method(
        "Integrated gradients + gradient rollout",
        "integrated gradients where they credit the patch; below those, gradient rollout ranks the rest",
        _torch_side("integrated_gradients_rollout"), needs_gradients=True),
    "embedding_integrated_gradients": Method(
        "Integrated gradients on the embeddings", "integrated gradients on the patch embeddings",
        _torch_side("embedding_integrated_gradients"), needs_gradients=True, needs_attentions=False),
}


def check_method(method: str) -> Method:
    """The registered method of that name; a UserError listing the names otherwise."""
    if not isinstance(method, str) or method not in METHODS:  # a list or a dict cannot even be looked up
        raise UserError(f"method: expected one of {', '.join(METHODS)}, got {str(method)[:40]!r}")
    return METHODS[method]
