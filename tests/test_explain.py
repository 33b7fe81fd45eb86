"""Explanation methods (vit_hub/explain/: attribution, run, gradients): every method's maps, what the
registry says each needs, the gradient ones against their definitions, occlusion against a loop."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from vit_hub.errors import UserError
from vit_hub.explain.attribution import METHODS, check_method, occlusion
from vit_hub.explain.blanking import blank_patches, blank_pixels
from vit_hub.explain.gradients import (attention_gradients, embedding_attributions, gradient_rollout,
                                       pixel_attributions, with_context)
from vit_hub.explain.run import explain, torch_forward, torch_logits
from vit_hub.hub.pretrained import HubVisionTransformer


def tiny_model(pooling="cls", in_channels=1, **overrides) -> HubVisionTransformer:
    torch.manual_seed(0)
    model = HubVisionTransformer(image_size=16, patch_size=4, in_channels=in_channels, num_classes=3, embed_dim=16,
                              depth=2, num_heads=2, pooling=pooling, **overrides).eval()
    with torch.no_grad():  # a non-zero head, so gradients reach the attention
        model.head.weight.normal_()
    return model


def pixels_of(batch=2, channels=1, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, channels, 16, 16)).astype(np.float32)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_gives_one_map_per_image_in_0_1(method, pooling):
    model = tiny_model(pooling)
    logits, attentions, maps = explain(model, pixels_of(3), method)
    assert logits.shape == (3, 3) and attentions.shape == (2, 3, 2, 17, 17)
    assert maps.shape == (3, 4, 4) and maps.dtype == np.float32
    assert maps.min() >= 0.0 and maps.max() <= 1.0 and np.isfinite(maps).all()
    with torch.no_grad():
        np.testing.assert_allclose(logits, model(torch.from_numpy(pixels_of(3))).logits.numpy(), atol=1e-5)


def test_unknown_method_is_refused():
    with pytest.raises(UserError, match="method: expected one of rollout"):
        check_method("saliency")
    with pytest.raises(UserError, match="method: expected one of rollout"):
        explain(tiny_model(), pixels_of(1), "saliency")


def test_the_registry_says_what_each_method_needs():
    """The ONNX backend offers exactly the methods that need no gradients; those compute from a
    forward pass alone, and the ones that need no attentions from a graph without them."""
    assert {name for name, method in METHODS.items() if method.runs_on_onnx} == {"rollout", "last_attention",
                                                                                   "occlusion"}
    assert {name for name, method in METHODS.items() if not method.quick} == {"occlusion"}
    model = tiny_model()
    pixels = torch.from_numpy(pixels_of(2))
    forward = torch_forward(model, pixels)
    targets = forward.logits.argmax(-1)
    for name, method in METHODS.items():
        if not method.runs_on_onnx:
            continue
        seen = forward if method.needs_attentions else forward._replace(attentions=None)
        np.testing.assert_array_equal(method.compute(seen, targets, model.config), explain(model, pixels, name).maps)


def test_reading_the_registry_imports_no_torch():
    code = "import sys, vit_hub.explain.attribution; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gradient_rollout_follows_the_chosen_class():
    model = tiny_model()
    pixels = torch.randn(2, 1, 16, 16)
    logits, attentions, gradients = attention_gradients(model, pixels, class_index=[0, 2])
    assert attentions.shape == gradients.shape == (2, 2, 2, 17, 17)
    assert gradients.abs().sum() > 0
    maps = gradient_rollout(attentions, gradients)
    assert maps.shape == (2, 4, 4) and 0.0 <= maps.min() and maps.max() <= 1.0
    _, _, other = attention_gradients(model, pixels, class_index=1)
    assert not np.allclose(gradient_rollout(attentions, other), maps)
    np.testing.assert_allclose(model(pixels).logits.detach(), logits, atol=1e-5)
    assert all(not block.attention._forward_hooks for block in model.blocks)  # no hooks needed


def test_gradient_rollout_checks_shapes():
    attentions = np.full((2, 1, 2, 10, 10), 0.1, dtype=np.float32)
    with pytest.raises(ValueError, match="gradients"):
        gradient_rollout(attentions, np.zeros((1, 2, 3), dtype=np.float32), grid_size=(3, 3))


@pytest.mark.parametrize("attribute", [pixel_attributions, embedding_attributions])
def test_integrated_gradients_are_complete(attribute):
    """Sundararajan et al.'s completeness: attributions add up to logit(image) - logit(blank);
    with 64 steps the midpoint rule is within a few percent."""
    model = tiny_model(in_channels=3)
    pixels = pixels_of(2, 3)
    logits, _, attributions, *_ = attribute(model, pixels, class_index=[0, 1], steps=64)
    blank = np.broadcast_to(blank_pixels(model.config)[None, :, None, None], pixels.shape).copy()
    with torch.no_grad():
        blank_logits = model(torch.from_numpy(blank)).logits
    difference = (logits - blank_logits)[[0, 1], [0, 1]]
    total = attributions.reshape(2, -1).sum(1)
    torch.testing.assert_close(total, difference, atol=0.05 * difference.abs().max().item(), rtol=0)


def test_gradient_x_input_is_one_step_at_the_image():
    model = tiny_model()
    pixels = torch.from_numpy(pixels_of(1)).requires_grad_(True)
    logit = model(pixels).logits[0, 2]
    (gradient,) = torch.autograd.grad(logit, pixels)
    blank = torch.from_numpy(blank_pixels(model.config))[None, :, None, None]
    expected = ((pixels - blank) * gradient).sum(1).reshape(1, 4, 4, 4, 4).sum((2, 4))
    _, _, attributions, _ = pixel_attributions(model, pixels.detach(), class_index=2, integrated=False)
    torch.testing.assert_close(attributions, expected.detach(), atol=1e-5, rtol=1e-4)


def test_pixel_attributions_pass_gives_the_images_own_logits_attentions_and_attention_gradients():
    """The images ride in the same batch as their paths: their rows must be what a pass of the
    images alone gives (for the predicted classes), untouched by the path rows."""
    model = tiny_model(in_channels=3)
    pixels = pixels_of(2, 3)
    logits, attentions, _, gradients = pixel_attributions(model, pixels)
    alone_logits, alone_attentions, alone_gradients = attention_gradients(model, torch.from_numpy(pixels))
    torch.testing.assert_close(logits, alone_logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(attentions, alone_attentions, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gradients, alone_gradients, atol=1e-5, rtol=1e-4)
    assert gradients.abs().sum() > 0


def test_embedding_attributions_leave_no_hook_on_the_model_even_on_error():
    model = tiny_model()
    with pytest.raises(RuntimeError):
        embedding_attributions(model, torch.randn(1, 1, 16, 16), class_index=7)  # no class 7
    assert not model.patch_embedding._forward_hooks


def test_occlusion_is_the_fall_in_log_probability_of_each_blanked_patch():
    model = tiny_model()
    pixels = pixels_of(2)
    blank = blank_pixels(model.config)
    maps = occlusion(torch_logits(model), pixels, [1, 2], (4, 4), (4, 4), blank, chunk=7)
    with torch.no_grad():
        def log_probability(images, target):
            return model(torch.from_numpy(images)).logits.log_softmax(-1)[:, target].numpy()
        for index, target in enumerate((1, 2)):
            falls = []
            for patch in range(16):
                chosen = np.zeros((1, 4, 4), bool)
                chosen.flat[patch] = True
                occluded = blank_patches(pixels[index:index + 1], chosen, (4, 4), blank)
                falls.append(log_probability(pixels[index:index + 1], target) - log_probability(occluded, target))
            falls = np.concatenate(falls).reshape(4, 4)
            np.testing.assert_allclose(maps[index], (falls - falls.min()) / (falls.max() - falls.min()), atol=1e-4)


def test_blank_is_black_paper_for_grayscale_and_the_mean_colour_for_colour():
    grey = tiny_model().config
    np.testing.assert_allclose(blank_pixels(grey), (0.0 - np.asarray(grey.mean)) / np.asarray(grey.std))
    assert (blank_pixels(tiny_model(in_channels=3).config) == 0).all()


def test_with_context_ranks_what_ig_credits_first_then_the_rest_by_the_context_map():
    attributions = np.array([[[4.0, 2.0, 0.0, -3.0]]], dtype=np.float32)  # a 1x4 grid
    context = np.array([[[0.0, 0.1, 0.2, 1.0]]], dtype=np.float32)
    order = np.argsort(-with_context(attributions, context).ravel())
    assert list(order) == [0, 1, 3, 2]  # the credited patches, then the negative one the context ranks above the empty one


def test_embedding_attributions_leave_other_forward_passes_alone():
    """While embedding_attributions runs the model from its path of embeddings (the app serves
    requests at once), a forward pass of other pixels gets its own embeddings."""
    model = tiny_model()
    other = torch.from_numpy(pixels_of(1, seed=5))
    with torch.no_grad():
        expected = model(other).logits
    calls, seen = [], []
    original = model.head.forward

    def head_with_a_second_request(features):
        calls.append(True)
        if len(calls) == 2:  # the second head call is the pass along the path
            with torch.no_grad():
                seen.append(model(other).logits)
        return original(features)

    model.head.forward = head_with_a_second_request
    embedding_attributions(model, torch.from_numpy(pixels_of(1)), class_index=0)
    torch.testing.assert_close(seen[0], expected)
