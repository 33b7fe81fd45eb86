"""The explanation methods kept for comparison (bench/other_methods.py): their maps, their
definitions, and the measurements that put them there instead of in vit_hub's registry."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.other_methods import OTHER_METHODS, attention_gradient
from vit_hub.explain.attribution import METHODS
from vit_hub.explain.gradients import attention_gradients
from vit_hub.explain.run import explain
from vit_hub.hub.pretrained import HubVisionTransformer

ROOT = Path(__file__).resolve().parents[1]
MEASURED = sorted(ROOT.glob("models/*/faithfulness.json"))


def tiny_model(pooling="cls") -> HubVisionTransformer:
    torch.manual_seed(0)
    model = HubVisionTransformer(image_size=16, patch_size=4, in_channels=1, num_classes=3, embed_dim=16,
                              depth=2, num_heads=2, pooling=pooling).eval()
    with torch.no_grad():  # a non-zero head, so gradients reach the attention
        model.head.weight.normal_()
    return model


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("name", list(OTHER_METHODS))
def test_every_other_method_gives_one_map_per_image_in_0_1(name, pooling):
    model = tiny_model(pooling)
    pixels = np.random.default_rng(0).normal(size=(3, 1, 16, 16)).astype(np.float32)
    logits, attentions, maps = explain(model, pixels, OTHER_METHODS[name])
    assert logits.shape == (3, 3) and attentions.shape == (2, 3, 2, 17, 17)
    assert maps.shape == (3, 4, 4) and maps.dtype == np.float32
    assert maps.min() >= 0.0 and maps.max() <= 1.0 and np.isfinite(maps).all()
    assert OTHER_METHODS[name].needs_gradients and not OTHER_METHODS[name].runs_on_onnx
    assert name not in METHODS


def test_attention_gradient_is_the_positive_product_read_from_the_class_token():
    model = tiny_model()
    _, attentions, gradients = attention_gradients(model, torch.randn(1, 1, 16, 16))
    product = (attentions * gradients).clamp(min=0).mean(2)[:, 0, 0, 1:]  # [L, N]
    for last_only, expected in ((False, product.sum(0)), (True, product[-1])):
        maps = attention_gradient(attentions, gradients, last_only=last_only)[0].ravel()
        expected = expected.numpy()
        np.testing.assert_allclose(maps, (expected - expected.min()) / (expected.max() - expected.min()), atol=1e-5)


def test_attention_gradient_checks_shapes():
    attentions = np.full((2, 1, 2, 10, 10), 0.1, dtype=np.float32)
    with pytest.raises(ValueError, match="gradients"):
        attention_gradient(attentions, np.zeros((1, 2, 3), dtype=np.float32), grid_size=(3, 3))


def dominates(better: dict, worse: dict) -> bool:
    """Lower deletion AUC and higher insertion AUC on every measured model."""
    return all(better[model]["deletion_auc"] < worse[model]["deletion_auc"]
               and better[model]["insertion_auc"] > worse[model]["insertion_auc"] for model in better)


def measured(name: str) -> dict:
    rows = {path.parent.name: json.loads(path.read_text())["methods"] for path in MEASURED}
    return {model: methods[name] for model, methods in rows.items()}


def test_the_split_between_vit_hub_and_bench_follows_the_measurements():
    """Each method here measured worse than one of vit_hub's on every model; none of vit_hub's
    measured worse than another vit_hub method that runs wherever it does."""
    assert len(MEASURED) >= 2  # the MNIST model and the distractor set
    for name in OTHER_METHODS:
        assert any(dominates(measured(better), measured(name)) for better in METHODS), name
    for name, method in METHODS.items():
        rivals = [other for other, rival in METHODS.items()
                  if other != name and (rival.runs_on_onnx or not method.runs_on_onnx)]
        assert not any(dominates(measured(rival), measured(name)) for rival in rivals), name
