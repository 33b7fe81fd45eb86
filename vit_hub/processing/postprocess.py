"""Model output -> probabilities and ranked labels. Torch-free (NumPy), like `preprocess`,
so the PyTorch predictor, the ONNX runtime and the app rank classes the same way."""

from __future__ import annotations

import numpy as np

from vit_hub.errors import UserError


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """[B, classes] logits -> probabilities, softmax(logits / temperature), computed stably in
    float32 or wider. A model's fitted temperature is `config.temperature` (vit_hub.train.calibration)."""
    scaled = logits / temperature
    shifted = scaled - scaled.max(axis=-1, keepdims=True)
    exponentials = np.exp(shifted)
    return exponentials / exponentials.sum(axis=-1, keepdims=True)


def top_k(probabilities: np.ndarray, labels: list[str], k: int) -> list[list[tuple[str, float]]]:
    """[B, classes] probabilities -> per image the k (label, probability) pairs, best first."""
    if k < 1:
        raise UserError(f"top_k: expected a positive int, got {k}")
    k = min(k, probabilities.shape[1])
    order = np.argsort(-probabilities, axis=1)[:, :k]
    return [[(labels[i], float(row[i])) for i in picks] for row, picks in zip(probabilities, order)]
