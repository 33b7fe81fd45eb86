"""Attention rollout and overlays: invariants, a slow reference, both array types, ONNX."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vit_hub.errors import UserError
from vit_hub.explain.rollout import (add_residual, attention_rollout, discard_lowest, fuse_heads, heatmap,
                                     last_layer_attention, layer_rollouts, overlay)
from vit_hub.hub.pretrained import HubVisionTransformer


def random_attentions(depth=3, batch=4, heads=2, tokens=7, seed=0) -> np.ndarray:
    """Row-stochastic attention weights [depth, batch, heads, tokens, tokens]."""
    logits = np.random.default_rng(seed).normal(size=(depth, batch, heads, tokens, tokens)) * 2
    weights = np.exp(logits)
    return (weights / weights.sum(-1, keepdims=True)).astype(np.float32)


def reference_rollout(attentions, head_fusion, discard_ratio, grid, pooling="cls"):
    """Plain loops over batch items, one matrix at a time: what the vectorised code must equal."""
    depth, batch, _, tokens, _ = attentions.shape
    maps = []
    for b in range(batch):
        joint = np.eye(tokens)
        for layer in range(depth):
            fused = getattr(np, head_fusion)(attentions[layer, b].astype(np.float64), axis=0)
            patches = fused[1:, 1:]
            count = int(discard_ratio * patches.size)
            if count:
                patches[patches < np.sort(patches, axis=None)[count]] = 0.0
            mixed = fused + np.eye(tokens)
            mixed /= mixed.sum(axis=1)[:, None]
            joint = mixed @ joint
        row = joint[0, 1:] if pooling == "cls" else joint[1:, 1:].mean(axis=0)
        maps.append(((row - row.min()) / (row.max() - row.min())).reshape(grid))
    return np.stack(maps)


@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("discard_ratio", [0.0, 0.5, 0.9])
def test_matches_per_item_reference(head_fusion, discard_ratio):
    attentions = random_attentions(tokens=13)  # 12 patches in a 3x4 grid
    maps = attention_rollout(attentions, head_fusion, discard_ratio, grid_size=(3, 4))
    assert maps.shape == (4, 3, 4) and maps.dtype == np.float32
    expected = reference_rollout(attentions, head_fusion, discard_ratio, (3, 4))
    np.testing.assert_allclose(maps, expected, atol=1e-5)


def test_mean_pooling_reads_the_patch_rows():
    attentions = random_attentions(tokens=13)
    maps = attention_rollout(attentions, "max", 0.3, grid_size=(3, 4), pooling="mean")
    np.testing.assert_allclose(maps, reference_rollout(attentions, "max", 0.3, (3, 4), "mean"), atol=1e-5)
    assert not np.allclose(maps, attention_rollout(attentions, "max", 0.3, grid_size=(3, 4)))
    with pytest.raises(UserError, match="pooling"):
        attention_rollout(attentions, grid_size=(3, 4), pooling="max")


@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
def test_rows_sum_to_one_after_discard(head_fusion):
    """Each row after discard and residual is (the weights discard kept + I) / its sum: rows of
    any matrix sum to one after that division, so the check is the matrix itself, built here
    from an independent discard (the lowest 80 % of each matrix's patch-to-patch weights)."""
    fused = fuse_heads(random_attentions(), head_fusion)  # [L, B, T, T]
    mixed = add_residual(discard_lowest(fused, 0.8))
    np.testing.assert_allclose(mixed.sum(axis=-1), 1.0, atol=1e-6)
    patches = fused[..., 1:, 1:]  # [L, B, N, N]
    flat = np.sort(patches.reshape(*patches.shape[:2], -1), axis=-1)
    lowest_kept = flat[..., int(0.8 * flat.shape[-1])][..., None, None]  # [L, B, 1, 1]
    kept = np.where(patches < lowest_kept, 0.0, patches)
    assert ((kept == 0).sum(axis=(-2, -1)) == int(0.8 * flat.shape[-1])).all()  # no ties among random weights
    expected = fused.astype(np.float64)
    expected[..., 1:, 1:] = kept
    expected += np.eye(fused.shape[-1])
    expected /= expected.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(mixed, expected, atol=1e-6)


def test_discard_spares_class_token_and_treats_each_sample_alone():
    fused = fuse_heads(random_attentions(batch=3, tokens=10), "mean")  # [L, B, T, T]
    kept = discard_lowest(fused, 0.5)
    np.testing.assert_array_equal(kept[..., 0, :], fused[..., 0, :])
    np.testing.assert_array_equal(kept[..., :, 0], fused[..., :, 0])
    zeros = (kept[..., 1:, 1:] == 0).reshape(*kept.shape[:2], -1).sum(-1)
    assert (zeros == int(0.5 * 81)).all()  # every layer of every sample, not only item 0
    survivors = np.where(kept[..., 1:, 1:] > 0, fused[..., 1:, 1:], np.inf).min(axis=(-2, -1))
    dropped = np.where(kept[..., 1:, 1:] == 0, fused[..., 1:, 1:], -np.inf).max(axis=(-2, -1))
    assert (dropped <= survivors).all()  # the weakest ones went


def test_batch_items_are_independent():
    attentions = random_attentions(batch=5)
    together = attention_rollout(attentions, grid_size=(2, 3))
    alone = [attention_rollout(attentions[:, i:i + 1], grid_size=(2, 3))[0] for i in range(5)]
    np.testing.assert_allclose(together, np.stack(alone), atol=1e-6)
    assert not np.allclose(together[0], together[1])


def test_non_square_grid_keeps_row_major_layout():
    tokens = 1 + 2 * 3
    attentions = np.full((2, 1, 1, tokens, tokens), 1e-3, dtype=np.float32)
    attentions[..., 0, 1 + 5] = 1.0  # the class token looks at patch 5 = row 1, column 2
    attentions /= attentions.sum(-1, keepdims=True)
    maps = attention_rollout(attentions, grid_size=(2, 3))
    assert maps.shape == (1, 2, 3)
    assert np.unravel_index(maps[0].argmax(), (2, 3)) == (1, 2)


def test_non_square_grid_needs_grid_size():
    with pytest.raises(ValueError, match="grid_size"):
        attention_rollout(random_attentions(tokens=7))
    with pytest.raises(ValueError, match="does not match"):
        attention_rollout(random_attentions(tokens=7), grid_size=(2, 2))


def test_square_grid_is_inferred():
    assert attention_rollout(random_attentions(tokens=17)).shape == (4, 4, 4)


def test_identity_and_uniform_attention_give_uniform_maps():
    """Rollout of these is uniform whatever discard does (every patch is alike), so discard's own
    output is checked too: tied weights share one fate, and with all of them tied none goes."""
    tokens = 10
    identity = np.broadcast_to(np.eye(tokens, dtype=np.float32), (4, 2, 3, tokens, tokens))
    uniform = np.full((4, 2, 3, tokens, tokens), 1.0 / tokens, dtype=np.float32)
    for attentions in (identity, uniform):
        for discard_ratio in (0.0, 0.5):
            maps = attention_rollout(attentions, discard_ratio=discard_ratio)
            assert maps.shape == (2, 3, 3)
            np.testing.assert_allclose(maps, maps[:, :1, :1] * np.ones_like(maps))
            fused = fuse_heads(attentions, "mean")
            np.testing.assert_array_equal(discard_lowest(fused, discard_ratio), fused)
    # The attention to patch 1 a hair below the rest: those 9 of the 81 weights are the lowest and
    # go; the 72 tied ones are all kept, though discarding half would have taken 31 of them.
    nudged = fuse_heads(uniform, "mean").copy()
    nudged[..., 1:, 1] -= 1e-3
    kept = discard_lowest(nudged, 0.5)
    assert (kept[..., 1:, 1] == 0).all()
    np.testing.assert_array_equal(np.delete(kept, 1, axis=-1), np.delete(nudged, 1, axis=-1))


def test_maps_span_zero_to_one():
    maps = attention_rollout(random_attentions(batch=6, tokens=26), "max", 0.3)
    np.testing.assert_allclose(maps.min(axis=(1, 2)), 0.0)
    np.testing.assert_allclose(maps.max(axis=(1, 2)), 1.0)


def test_torch_input_equals_numpy_input():
    attentions = random_attentions(tokens=10)
    from_torch = attention_rollout(torch.from_numpy(attentions).requires_grad_(), "min", 0.2)
    assert isinstance(from_torch, np.ndarray)
    np.testing.assert_array_equal(from_torch, attention_rollout(attentions, "min", 0.2))


def test_layer_rollouts_end_with_the_full_rollout():
    attentions = random_attentions(depth=4, tokens=10)
    per_layer = layer_rollouts(attentions, "mean", 0.1)
    assert per_layer.shape == (4, 4, 3, 3)
    np.testing.assert_array_equal(per_layer[-1], attention_rollout(attentions, "mean", 0.1))
    np.testing.assert_allclose(per_layer[1], attention_rollout(attentions[:2], "mean", 0.1), atol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(head_fusion="median"), "head_fusion"),
    (dict(discard_ratio=1.0), "discard_ratio"),
    (dict(discard_ratio=-0.1), "discard_ratio"),
])
def test_bad_arguments_are_rejected(kwargs, message):
    with pytest.raises(UserError, match=message):
        attention_rollout(random_attentions(tokens=10), **kwargs)


def test_bad_shape_is_rejected():
    with pytest.raises(ValueError, match=r"\[depth, batch, heads, tokens, tokens\]"):
        attention_rollout(np.zeros((2, 3, 5, 5), dtype=np.float32))


def tiny_model(image_size=(8, 12), **overrides) -> HubVisionTransformer:
    torch.manual_seed(0)
    values = dict(image_size=image_size, patch_size=4, in_channels=1, num_classes=3, embed_dim=16,
                  depth=2, num_heads=2)
    model = HubVisionTransformer(**(values | overrides)).eval()
    with torch.no_grad():  # a non-zero head, so gradients reach the attention
        model.head.weight.normal_()
    return model


def test_rollout_of_a_real_non_square_model():
    model = tiny_model()
    with torch.no_grad():
        _, attentions = model(torch.randn(3, 1, 8, 12), output_attentions=True)
    maps = attention_rollout(attentions, grid_size=model.config.grid_size)
    assert maps.shape == (3, 2, 3)


def test_last_layer_attention_reads_the_pooled_row_of_the_last_layer():
    attentions = random_attentions(tokens=13)  # [3, 4, 2, 13, 13]
    assert last_layer_attention(attentions, grid_size=(3, 4)).shape == (4, 3, 4)
    fused = attentions[-1].mean(axis=1)  # [B, T, T]
    for pooling, rows in (("cls", fused[:, 0, 1:]), ("mean", fused[:, 1:, 1:].mean(axis=1))):
        expected = rows.reshape(4, 3, 4)
        low, high = expected.min(axis=(1, 2), keepdims=True), expected.max(axis=(1, 2), keepdims=True)
        np.testing.assert_allclose(last_layer_attention(attentions, (3, 4), pooling), (expected - low) / (high - low),
                                   atol=1e-5)


def test_overlay_has_the_image_size_and_blends():
    image = Image.new("L", (50, 30), 128)
    mask = np.array([[0.0, 1.0], [0.0, 1.0]], dtype=np.float32)
    blended = overlay(image, mask, alpha=0.5, colormap="jet")
    assert blended.size == (50, 30) and blended.mode == "RGB"
    assert np.array_equal(np.asarray(overlay(image, mask, alpha=0.0)), np.asarray(image.convert("RGB")))
    heat = heatmap(mask, (50, 30), "gray")[..., 0].astype(int)  # [30, 50]
    assert heat[:, 0].max() == 0 and heat[:, -1].min() == 255
    assert (np.diff(heat[15]) >= 0).all() and len(np.unique(heat[15])) > 10  # bilinear, not blocky


def test_overlay_rejects_bad_arguments():
    image = Image.new("RGB", (8, 8))
    with pytest.raises(UserError, match="colormap"):
        overlay(image, np.zeros((2, 2)), colormap="no-such-map")
    with pytest.raises(UserError, match="alpha"):
        overlay(image, np.zeros((2, 2)), alpha=1.5)
    with pytest.raises(ValueError, match="2-D mask"):
        overlay(image, np.zeros((1, 2, 2)))


def test_onnx_attentions_give_the_torch_map(tmp_path):
    from vit_hub import export

    model = tiny_model(image_size=16)
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    onnx_path = export.export_onnx(model_dir, tmp_path / "onnx" / "model.onnx", output_attentions=True)
    classifier = export.OnnxClassifier(onnx_path, providers="cpu")
    pixels = np.random.default_rng(0).normal(size=(3, 1, 16, 16)).astype(np.float32)
    _, onnx_attentions = classifier.run(pixels, output_attentions=True)
    with torch.no_grad():
        _, torch_attentions = model(torch.from_numpy(pixels), output_attentions=True)
    np.testing.assert_allclose(onnx_attentions, torch.stack(torch_attentions).numpy(), atol=1e-5)
    for fusion in ("mean", "max"):
        np.testing.assert_allclose(attention_rollout(onnx_attentions, fusion, 0.5),
                                   attention_rollout(torch_attentions, fusion, 0.5), atol=1e-4)
