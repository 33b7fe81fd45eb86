"""Classify image files, PIL images or arrays with a loaded model (torch backend)."""

from __future__ import annotations

import torch

from .model import VisionTransformer
from .postprocess import softmax
from .postprocess import top_k as rank_top_k
from .preprocess import ImageInput, preprocess_batch


@torch.no_grad()
def predict_images(model: VisionTransformer, images: list[ImageInput], top_k: int = 5,
                   batch_size: int = 64) -> list[list[tuple[str, float]]]:
    """Top-k predictions for each image, preprocessed exactly as the config says."""
    model.config.check_has_head("predict")
    model.eval()
    device = next(model.parameters()).device
    results = []
    for start in range(0, len(images), batch_size):
        pixels = torch.from_numpy(preprocess_batch(images[start:start + batch_size], model.config))
        logits = model(pixels.to(device)).logits.float().cpu().numpy()
        probabilities = softmax(logits, model.config.temperature)
        results += rank_top_k(probabilities, model.config.labels, top_k)
    return results
