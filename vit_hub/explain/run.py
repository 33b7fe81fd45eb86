"""Run any explanation method on the torch model: `explain(model, pixels, method)`.

    explain(model, pixels, "integrated_gradients")      # any name in attribution.METHODS
    -> Explained(logits, attentions, maps)              # maps [B, grid_h, grid_w] in [0, 1]

The registry (`vit_hub.explain.attribution.METHODS`) says what each method needs: one that needs
gradients computes everything from the model itself (`vit_hub.explain.gradients`); the others read
one forward pass with the attentions, the same way they read ONNX Runtime's outputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vit_hub.explain.attribution import Forward, Method, check_method
from vit_hub.explain.gradients import INTEGRATED_GRADIENT_STEPS, Explained
from vit_hub.explain.rollout import as_numpy


def explain(model: Any, pixels: Any, method: str | Method = "rollout", class_index: Any = None,
            steps: int = INTEGRATED_GRADIENT_STEPS) -> Explained:
    """Logits, attentions and the `method` map for pixels [B, C, H, W] (tensor or array).

    method: a name in attribution.METHODS, or a `Method` (bench/other_methods.py holds more).
    class_index: int or [B] ints, the class explained; the predicted one when None.
    steps: points on the path for the integrated gradients methods (the others ignore it).
    """
    chosen = method if isinstance(method, Method) else check_method(method)
    pixels = torch.as_tensor(pixels, dtype=torch.float32)
    if chosen.needs_gradients:
        return chosen.compute(model, pixels, class_index, steps)
    forward = torch_forward(model, pixels)
    targets = forward.logits.argmax(-1) if class_index is None else np.asarray(class_index)
    return Explained(forward.logits, forward.attentions, chosen.compute(forward, targets, model.config))


def torch_forward(model: Any, pixels: torch.Tensor) -> Forward:
    """One forward pass of the torch model, as the methods that need no gradients read it."""
    with torch.inference_mode():
        logits, attentions = model(pixels, output_attentions=True)
    return Forward(pixels.numpy(), as_numpy(logits), as_numpy(attentions), torch_logits(model))


def torch_logits(model: Any):
    """The model as `attribution.occlusion` wants it: float32 array -> logits array."""
    def logits_of(pixels: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(pixels)).logits.numpy()
    return logits_of
