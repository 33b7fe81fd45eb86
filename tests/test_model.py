"""The model and its config: shapes, attention paths, save/load (vit_hub.hub.pretrained), and every input error."""

from __future__ import annotations

import json
import math

import pytest
import safetensors.torch
import torch
from torch import nn

from conftest import tiny_config
from vit_hub.hub import pretrained
from vit_hub.model.config import (DIGIT_LABELS, PHOTO_SIDE, PRESETS, SMALL_DATA_IMAGES, ViTConfig,
                                  is_small_photo_folder, suggest_for_data)
from vit_hub.model.patches import PatchEmbedding
from vit_hub.model.positions import sincos_positions
from vit_hub.model.vit import Attention, DropPath, VisionTransformer, upgrade_state_dict


def randomized(model: VisionTransformer, seed: int = 0) -> VisionTransformer:
    """The model with every parameter drawn at random, the zero-initialised head included
    (with a zero head every logit is 0 and comparisons of logits prove nothing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model.eval()


def images(batch: int, channels: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, channels, height, width, generator=torch.Generator().manual_seed(seed))


# Shapes ----------------------------------------------------------------------------------
# Parameter counts of timm's vit_{tiny,small,base}_patch16_224 (1000 classes) minus one
# embed_dim: timm also gives the class token a position, ours gives positions to patches only.
TIMM_PARAMETERS = {"tiny": 5_717_416 - 192, "small": 22_050_664 - 384, "base": 86_567_656 - 768}


@pytest.mark.parametrize("preset, side", [
    ("tiny", 224),
    ("small", 64),  # smaller inputs (positions interpolated) keep the wide models fast
    pytest.param("base", 64, marks=pytest.mark.slow),
])
def test_imagenet_presets_have_vit_paper_sizes_and_run_one_image(preset, side):
    torch.manual_seed(0)
    model = VisionTransformer(**PRESETS[preset]).eval()
    assert sum(p.numel() for p in model.parameters()) == TIMM_PARAMETERS[preset]
    config = model.config
    tokens = 1 + (side // 16) ** 2
    with torch.no_grad():
        logits, attentions = model(torch.randn(1, 3, side, side), output_attentions=True)
    assert logits.shape == (1, 1000)
    assert torch.stack(attentions).shape == (12, 1, config.num_heads, tokens, tokens)


@pytest.mark.parametrize("preset", ["mnist", "small-data"])
def test_small_presets_forward_a_batch(preset):
    model = VisionTransformer(**PRESETS[preset]).eval()
    config = model.config
    with torch.no_grad():
        logits, attentions = model(images(2, config.in_channels, *config.image_size), output_attentions=True)
    assert logits.shape == (2, config.num_classes)
    assert len(attentions) == config.depth
    assert all(weights.shape == (2, config.num_heads, config.num_tokens, config.num_tokens) for weights in attentions)


def test_mnist_preset_is_the_documented_architecture():
    config = ViTConfig.from_preset("mnist")
    assert (config.image_size, config.patch_size, config.in_channels) == ([28, 28], [4, 4], 1)
    assert (config.embed_dim, config.depth, config.num_heads, config.num_tokens) == (64, 6, 4, 50)
    assert config.labels == list(DIGIT_LABELS)


@pytest.mark.parametrize("options", [
    dict(),
    dict(pos_embedding="sincos", pooling="mean"),
    dict(patch_embedding="shifted", locality_attention=True),
    dict(patch_embedding="convstem", locality_attention=True),
    dict(patch_embedding="hybrid", locality_attention=True),
], ids=["learned-cls", "sincos-mean", "shifted-locality", "convstem-locality", "hybrid-locality"])
def test_non_square_images_and_patches(options):
    # 24x40 image, 4x8 patches: a 6x5 grid, 30 patches, 31 tokens.
    model = VisionTransformer(**tiny_config(image_size=[24, 40], patch_size=(4, 8), **options)).eval()
    assert model.config.grid_size == (6, 5)
    logits, attentions = model(images(3, 3, 24, 40), output_attentions=True)
    assert logits.shape == (3, 2)
    assert torch.stack(attentions).shape == (2, 3, 2, 31, 31)


@pytest.mark.parametrize("pos_embedding", ["learned", "sincos"])
def test_other_input_sizes_resize_the_positions(pos_embedding):
    model = randomized(VisionTransformer(**tiny_config(pos_embedding=pos_embedding)))  # built for 16x16
    logits, attentions = model(images(2, 3, 24, 32), output_attentions=True)  # a 6x8 grid
    assert logits.shape == (2, 2) and attentions[-1].shape[-1] == 1 + 6 * 8
    assert torch.isfinite(logits).all()


def test_a_config_or_its_fields_build_the_same_model():
    config = ViTConfig(**tiny_config())
    torch.manual_seed(0)
    from_config = VisionTransformer(config)
    torch.manual_seed(0)
    from_fields = VisionTransformer(**tiny_config())
    assert from_config.config is config and from_fields.config == config
    assert_same_weights(from_config, from_fields)
    with pytest.raises(TypeError, match="not both|got both"):
        VisionTransformer(config, depth=3)
    with pytest.raises(TypeError, match="expected a ViTConfig, got dict"):
        VisionTransformer(tiny_config())


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_forward_features_gives_every_token_and_the_head_reads_them(pooling):
    """forward_features returns all T tokens whatever the pooling (the class-token-only last
    block is forward's own shortcut), and forward_head of them gives forward's logits."""
    model = randomized(VisionTransformer(**tiny_config(pooling=pooling)))
    pixels = images(2, 3, 16, 16)
    with torch.no_grad():
        tokens, attentions = model.forward_features(pixels)
        logits = model(pixels).logits
    assert tokens.shape == (2, 17, 16) and attentions is None
    torch.testing.assert_close(model.forward_head(tokens), logits, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        _, attentions = model.forward_features(pixels, output_attentions=True)
    assert len(attentions) == 2 and attentions[-1].shape == (2, 2, 17, 17)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_forward_from_patches_runs_forward_on_the_embeddings_it_is_given(pooling):
    """embed_patches then forward_from_patches is forward, and other embeddings (points between
    two images', for integrated gradients) give what forward gives when the patch embedding
    layer outputs them: logits and attentions, at a size other than the trained one too."""
    model = randomized(VisionTransformer(**tiny_config(pooling=pooling)))
    pixels = images(2, 3, 16, 24)
    with torch.no_grad():
        patches, grid = model.embed_patches(pixels)
        other = patches.flip(0) * 0.5
        handle = model.patch_embedding.register_forward_hook(lambda *_: other)
        expected = model(pixels, output_attentions=True)
        handle.remove()
        got = model.forward_from_patches(other, grid, output_attentions=True)
        logits = model.forward_from_patches(other, grid).logits  # the class-token-only last block, with cls
    assert patches.shape == (2, 24, 16) and grid == (4, 6)
    torch.testing.assert_close(got.logits, expected.logits, atol=0, rtol=0)
    torch.testing.assert_close(torch.stack(got.attentions), torch.stack(expected.attentions), atol=0, rtol=0)
    torch.testing.assert_close(logits, expected.logits, atol=1e-5, rtol=1e-5)


def test_learned_positions_are_unchanged_at_the_trained_size():
    model = VisionTransformer(**tiny_config())
    assert model._positions(4, 4) is model.pos_embedding


# Attention -----------------------------------------------------------------------------------
PARITY_OPTIONS = [
    dict(),
    dict(locality_attention=True),
    dict(patch_embedding="shifted"),
    dict(patch_embedding="shifted", locality_attention=True, pooling="mean", pos_embedding="sincos"),
    dict(patch_embedding="convstem", locality_attention=True),
    dict(patch_embedding="hybrid", locality_attention=True, pooling="mean"),
    dict(dropout=0.3, attention_dropout=0.3, drop_path=0.3),  # all inactive in eval mode
]


@pytest.mark.parametrize("options", PARITY_OPTIONS, ids=[
    "plain", "locality", "shifted", "shifted-locality-mean-sincos", "convstem-locality", "hybrid-locality-mean",
    "dropouts"])
def test_fused_and_explicit_attention_give_the_same_logits(options):
    model = randomized(VisionTransformer(**tiny_config(**options)))
    pixels = images(4, 3, 16, 16)
    with torch.no_grad():
        fused, no_attentions = model(pixels)
        explicit, _ = model(pixels, output_attentions=True)
    assert no_attentions is None
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("locality", [False, True])
def test_class_token_only_block_gives_row_zero_of_the_full_block(locality):
    block = randomized(VisionTransformer(**tiny_config(locality_attention=locality))).blocks[-1]
    tokens = torch.randn(3, 17, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = block(tokens)
        cls_only, _ = block(tokens, queries=1)
    assert cls_only.shape == (3, 1, 16)
    torch.testing.assert_close(cls_only, full[:, :1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("locality", [False, True])
def test_fast_path_trains_like_the_full_network(locality):
    """The class-token-only last block changes no gradient: the fast path (what training
    runs) and the explicit path (every block whole) give the same parameter gradients."""
    model = randomized(VisionTransformer(**tiny_config(locality_attention=locality)))
    pixels, labels = images(4, 3, 16, 16), torch.tensor([0, 1, 1, 0])
    gradients = []
    for output_attentions in (False, True):
        model.zero_grad()
        logits = model(pixels, output_attentions=output_attentions).logits
        torch.nn.functional.cross_entropy(logits, labels).backward()
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, fast in gradients[0].items():
        torch.testing.assert_close(fast, gradients[1][name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("locality", [False, True])
def test_attention_module_paths_agree(locality):
    torch.manual_seed(0)
    attention = Attention(dim=24, num_heads=3, qkv_bias=True, attention_dropout=0.0, dropout=0.0,
                          locality=locality).eval()
    tokens = torch.randn(2, 7, 24)
    fused, no_weights = attention(tokens)
    explicit, weights = attention(tokens, output_attentions=True)
    assert no_weights is None and weights.shape == (2, 3, 7, 7)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)


def reference_attention(attention: Attention, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-head attention written per head, straight from the paper: q, k, v of head h are
    rows h*d:(h+1)*d of the query, key and value thirds of the fused projection."""
    dim = tokens.shape[-1]
    heads, head_dim = attention.num_heads, attention.head_dim
    weight, bias = attention.to_qkv.weight, attention.to_qkv.bias
    outputs, all_weights = [], []
    for head in range(heads):
        rows = slice(head * head_dim, (head + 1) * head_dim)
        q, k, v = (tokens @ weight[part * dim:][rows].T + bias[part * dim:][rows] for part in range(3))
        if attention.locality:
            scores = (q * attention.log_scale.exp()) @ k.transpose(-2, -1)
            scores = scores - torch.diag(torch.full((tokens.shape[1],), float("inf")))
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
        head_weights = scores.softmax(dim=-1)
        all_weights.append(head_weights)
        outputs.append(head_weights @ v)
    return attention.to_out(torch.cat(outputs, dim=-1)), torch.stack(all_weights, dim=1)


@pytest.mark.parametrize("locality", [False, True])
def test_attention_matches_a_per_head_reference(locality):
    torch.manual_seed(1)
    attention = Attention(dim=12, num_heads=3, qkv_bias=True, attention_dropout=0.0, dropout=0.0,
                          locality=locality).eval()
    if locality:
        with torch.no_grad():
            attention.log_scale.fill_(-0.2)  # not the default temperature
    tokens = torch.randn(2, 5, 12)
    expected_out, expected_weights = reference_attention(attention, tokens)
    out, weights = attention(tokens, output_attentions=True)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(attention(tokens)[0], expected_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("locality", [False, True])
def test_attention_rows_are_probabilities(locality):
    model = randomized(VisionTransformer(**tiny_config(locality_attention=locality)))
    _, attentions = model(images(3, 3, 16, 16), output_attentions=True)
    attentions = torch.stack(attentions)
    assert (attentions >= 0).all()
    torch.testing.assert_close(attentions.sum(dim=-1), torch.ones(attentions.shape[:-1]), atol=1e-5, rtol=0)
    diagonal = attentions.diagonal(dim1=-2, dim2=-1)
    if locality:  # locality self-attention: a token never attends to itself
        assert (diagonal == 0).all()
    else:
        assert (diagonal > 0).all()


def test_locality_temperature_is_learned_and_starts_at_the_usual_scale():
    model = VisionTransformer(**tiny_config(locality_attention=True, embed_dim=32, num_heads=2))
    scales = [block.attention.log_scale for block in model.blocks]
    assert all(scale.requires_grad for scale in scales)
    assert all(math.isclose(scale.exp().item(), 16**-0.5, rel_tol=1e-6) for scale in scales)
    assert "blocks.0.attention.log_scale" in model.state_dict()


def test_attention_weights_get_gradients_on_the_explicit_path():
    """A loss on the weights alone (the class token's attention to itself: rows sum to 1, so a
    plain sum would be constant) reaches the query/key projection, and not the head."""
    model = randomized(VisionTransformer(**tiny_config())).train()
    _, attentions = model(images(2, 3, 16, 16), output_attentions=True)
    torch.stack(attentions)[:, :, :, 0, 0].sum().backward()
    assert model.blocks[0].attention.to_qkv.weight.grad.abs().sum() > 0
    assert model.head.weight.grad is None


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_logits_differentiate_with_respect_to_the_returned_attentions(pooling):
    """The returned weights are the ones each block multiplied with its values, so
    autograd.grad(logit, attentions) works (Chefer et al.'s gradient rollout needs it) and
    equals what forward hooks on the attention modules would capture."""
    model = randomized(VisionTransformer(**tiny_config(pooling=pooling))).eval()
    pixels = images(2, 3, 16, 16)
    logits, attentions = model(pixels, output_attentions=True)
    gradients = torch.autograd.grad(logits[:, 1].sum(), attentions)
    assert len(gradients) == model.config.depth
    assert all(gradient.shape == weights.shape and gradient.abs().sum() > 0
               for gradient, weights in zip(gradients, attentions))

    hooked = []
    handles = [block.attention.register_forward_hook(lambda _m, _i, out: hooked.append(out[1]))
               for block in model.blocks]
    try:
        logits, _ = model(pixels, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    for expected, gradient in zip(torch.autograd.grad(logits[:, 1].sum(), hooked), gradients):
        torch.testing.assert_close(gradient, expected)


# Blocks and the whole forward against plain torch (no timm) ---------------------------------------
def layer_norm(norm: nn.LayerNorm, tokens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(tokens, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def reference_block(block, tokens: torch.Tensor) -> torch.Tensor:
    """A pre-norm block from its own weights: x + attention(LN(x)), then that + MLP(LN(that))."""
    attended, _ = reference_attention(block.attention, layer_norm(block.attention_norm, tokens))
    tokens = tokens + attended
    fc1, fc2 = block.mlp.fc1, block.mlp.fc2
    hidden = torch.nn.functional.gelu(layer_norm(block.mlp_norm, tokens) @ fc1.weight.T + fc1.bias)
    return tokens + hidden @ fc2.weight.T + fc2.bias


def reference_forward(model: VisionTransformer, pixels: torch.Tensor) -> torch.Tensor:
    """Logits of a plain-patch ViT from its weights: patches as a strided convolution, the class
    token before them, positions on the patches, the blocks, LayerNorm, pooling, head."""
    config, conv = model.config, model.patch_embedding.to_tokens
    patches = torch.nn.functional.conv2d(pixels, conv.weight, conv.bias, stride=config.patch_size)  # [B, D, h, w]
    patches = patches.flatten(2).transpose(1, 2) + model.pos_embedding  # [B, N, D]
    tokens = torch.cat([model.cls_token.expand(len(pixels), -1, -1), patches], dim=1)  # [B, T, D]
    for block in model.blocks:
        tokens = reference_block(block, tokens)
    tokens = layer_norm(model.norm, tokens)
    pooled = tokens[:, 0] if config.pooling == "cls" else tokens[:, 1:].mean(dim=1)  # mean: the patches only
    return pooled @ model.head.weight.T + model.head.bias


@pytest.mark.parametrize("locality", [False, True])
def test_block_adds_attention_then_mlp_to_its_input_as_a_plain_torch_reference_does(locality):
    block = randomized(VisionTransformer(**tiny_config(locality_attention=locality))).blocks[0]
    tokens = torch.randn(3, 17, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for output_attentions in (False, True):  # the fused and the explicit attention path
            out, _ = block(tokens, output_attentions)
            torch.testing.assert_close(out, reference_block(block, tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_forward_equals_a_plain_torch_reference_of_the_whole_model(pooling):
    model = randomized(VisionTransformer(**tiny_config(pooling=pooling)))
    pixels = images(3, 3, 16, 16)
    with torch.no_grad():
        expected = reference_forward(model, pixels)
        torch.testing.assert_close(model(pixels).logits, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(pixels, output_attentions=True).logits, expected, atol=1e-5, rtol=1e-5)


def test_mean_pooling_averages_the_patch_tokens_and_leaves_out_the_class_token():
    """A features-only model (no head) outputs its pooled features: the mean of tokens 1..N."""
    model = randomized(VisionTransformer(**tiny_config(pooling="mean", labels=None, num_classes=0)))
    pixels = images(2, 3, 16, 16)
    with torch.no_grad():
        tokens, _ = model.forward_features(pixels)  # [B, 1 + N, D], token 0 the class token
        pooled = model(pixels).logits  # [B, D]
    torch.testing.assert_close(pooled, tokens[:, 1:].mean(dim=1), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(pooled, tokens.mean(dim=1), atol=1e-3)  # the class token would move the mean


# Patch embedding, positions, stochastic depth -------------------------------------------------
def test_conv_stem_halves_the_image_down_to_the_patch_grid():
    model = VisionTransformer(**tiny_config(image_size=[16, 32], patch_size=[4, 8], patch_embedding="convstem"))
    strides = [layer.stride for layer in model.patch_embedding.convolutions if isinstance(layer, torch.nn.Conv2d)]
    assert strides == [(2, 2), (2, 2), (1, 2)]  # 4 = 2 x 2 rows, 8 = 2 x 2 x 2 columns
    tokens = model.patch_embedding(images(2, 3, 16, 32))
    assert tokens.shape == (2, 4 * 4, 16)


def test_hybrid_stem_is_twice_as_wide_with_a_second_convolution_at_each_resolution():
    def convolutions(patch_embedding):
        model = VisionTransformer(**tiny_config(image_size=64, patch_size=8, embed_dim=64,
                                                patch_embedding=patch_embedding))
        return [(layer.out_channels, layer.stride[0]) for layer in model.patch_embedding.convolutions
                if isinstance(layer, torch.nn.Conv2d)]

    assert convolutions("convstem") == [(8, 2), (16, 2), (32, 2)]
    assert convolutions("hybrid") == [(16, 2), (16, 1), (32, 2), (32, 1), (64, 2), (64, 1)]


def test_shifted_patches_move_half_a_patch_towards_each_corner():
    embedding = PatchEmbedding(in_channels=1, embed_dim=8, patch_size=[4, 8], shifted=True)
    image = torch.zeros(1, 1, 8, 16)
    image[0, 0, 3, 5] = 1.0  # half a patch is 2 rows and 4 columns
    shifted = embedding._diagonal_shifts(image)
    moved_to = [tuple(torch.nonzero(copy[0, 0]).squeeze(0).tolist()) for copy in shifted]
    assert moved_to == [(5, 9), (5, 1), (1, 9), (1, 1)]
    assert all(copy.shape == image.shape for copy in shifted)
    assert embedding.to_tokens.in_channels == 5  # the image and its four shifted copies
    assert embedding(image).shape == (1, 2 * 2, 8)


def test_conv_patch_embedding_is_one_linear_layer_per_patch():
    torch.manual_seed(0)
    embedding = PatchEmbedding(in_channels=3, embed_dim=6, patch_size=[2, 4], shifted=False)
    image = torch.randn(1, 3, 4, 8)
    patches = image.reshape(1, 3, 2, 2, 2, 4).permute(0, 2, 4, 1, 3, 5).reshape(1, 4, 3 * 2 * 4)  # row-major grid
    expected = patches @ embedding.to_tokens.weight.reshape(6, -1).T + embedding.to_tokens.bias
    torch.testing.assert_close(embedding(image), expected, atol=1e-5, rtol=1e-5)


def test_sincos_positions_are_fixed_and_distinct():
    positions = torch.from_numpy(sincos_positions(3, 5, 16))
    assert positions.shape == (15, 16) and positions.dtype == torch.float32 and positions.abs().max() <= 1.0
    torch.testing.assert_close(positions[0], torch.tensor([0.0] * 4 + [1.0] * 4 + [0.0] * 4 + [1.0] * 4))
    # patch 7 is row 1, column 2 (row-major): sin(y w) and sin(x w) at the lowest frequency w = 1
    torch.testing.assert_close(positions[7, [0, 8]], torch.tensor([math.sin(1.0), math.sin(2.0)]))
    assert torch.cdist(positions, positions).add(torch.eye(15)).min() > 0.1  # every position unique
    model = VisionTransformer(**tiny_config(pos_embedding="sincos"))
    assert torch.equal(model.pos_embedding[0], torch.from_numpy(sincos_positions(4, 4, 16)))
    assert "pos_embedding" not in dict(model.named_parameters())
    assert "pos_embedding" not in model.state_dict()  # rebuilt from the config, never saved
    with pytest.raises(ValueError, match="divisible by 4, got 18"):
        sincos_positions(2, 2, 18)


def test_drop_path_drops_whole_samples_and_keeps_the_mean():
    torch.manual_seed(0)
    drop = DropPath(0.5)
    x = torch.ones(4000, 3, 2)
    out = drop.train()(x)
    per_sample = out.reshape(4000, -1)
    assert set(per_sample.unique().tolist()) == {0.0, 2.0}
    assert (per_sample == per_sample[:, :1]).all()  # one decision per sample
    assert abs(out.mean().item() - 1.0) < 0.1
    assert torch.equal(drop.eval()(x), x)
    assert torch.equal(DropPath(0.0).train()(x), x)


def test_drop_path_rates_grow_linearly_with_depth():
    model = VisionTransformer(**tiny_config(depth=5, drop_path=0.2))
    rates = [block.drop_path.rate for block in model.blocks]
    assert rates == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2])


def test_initial_model_predicts_near_uniformly_and_its_first_step_reaches_the_body():
    """A zero head would predict exactly uniformly but pass the body no gradient (a small-data
    run then sits at chance for many epochs): the head starts small and random instead."""
    model = VisionTransformer(**tiny_config(num_classes=None, labels=["a", "b", "c"])).eval()
    logits = model(images(2, 3, 16, 16)).logits
    torch.testing.assert_close(logits.softmax(dim=-1), torch.full((2, 3), 1 / 3), atol=0.1, rtol=0)
    nn.functional.cross_entropy(logits, torch.tensor([0, 2])).backward()
    for name, parameter in model.named_parameters():
        if name.startswith(("patch_embedding", "blocks.0.")) and parameter.ndim > 1:
            assert parameter.grad.abs().sum() > 0, name


def test_training_mode_is_random_only_where_asked():
    model = randomized(VisionTransformer(**tiny_config(dropout=0.2, drop_path=0.2))).train()
    pixels = images(2, 3, 16, 16)
    assert not torch.equal(model(pixels).logits, model(pixels).logits)
    model.eval()
    assert torch.equal(model(pixels).logits, model(pixels).logits)


# Save and load ---------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [
    dict(),
    dict(pos_embedding="sincos", pooling="mean", patch_embedding="shifted", locality_attention=True),
    dict(patch_embedding="convstem"),
    dict(patch_embedding="hybrid"),
], ids=["plain", "sincos-shifted-locality", "convstem", "hybrid"])
def test_save_then_load_gives_identical_logits(tmp_path, options):
    model = randomized(pretrained.HubVisionTransformer(**tiny_config(image_size=[16, 24], **options)))
    model.save_pretrained(tmp_path)
    loaded = pretrained.HubVisionTransformer.from_pretrained(str(tmp_path))
    assert not loaded.training
    pixels = images(3, 3, 16, 24)
    assert torch.equal(model(pixels).logits, loaded(pixels).logits)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")) == []


def test_config_round_trip_turns_tuples_into_lists(tmp_path):
    kwargs = dict(image_size=(16, 24), patch_size=(4, 8), in_channels=3, embed_dim=16, depth=1, num_heads=2,
                  mlp_ratio=3, mean=(0.25,), std=(0.5, 0.25, 0.125), labels=("cat", "dog"), drop_path=0.1)
    model = pretrained.HubVisionTransformer(**kwargs)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["image_size"] == [16, 24] and saved["patch_size"] == [4, 8]
    assert saved["mean"] == [0.25, 0.25, 0.25] and saved["std"] == [0.5, 0.25, 0.125]
    assert saved["labels"] == ["cat", "dog"] and saved["num_classes"] == 2
    assert saved["mlp_ratio"] == 3.0
    assert set(saved) == set(ViTConfig.__dataclass_fields__)  # every field, defaults included
    loaded = pretrained.HubVisionTransformer.from_pretrained(str(tmp_path))
    assert loaded.config == model.config == ViTConfig(**kwargs)
    assert ViTConfig.from_dict(json.loads(json.dumps(model.config.to_dict()))) == model.config


def assert_same_weights(model: nn.Module, other: nn.Module) -> None:
    """The same tensor names, and every tensor equal (shape, dtype and values)."""
    ours, theirs = model.state_dict(), other.state_dict()
    assert list(ours) == list(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_config_json_rebuilds_an_identical_model(tmp_path):
    """config.json alone holds the architecture: a model built from it, seeded as the saved one
    was, has the same weights, and the saved weights load into it."""
    torch.manual_seed(0)
    model = pretrained.HubVisionTransformer(**tiny_config(pos_embedding="sincos", patch_embedding="shifted"))
    model.save_pretrained(tmp_path)
    config = ViTConfig.from_json(tmp_path / "config.json")
    torch.manual_seed(0)
    rebuilt = VisionTransformer(config)
    assert rebuilt.config == model.config
    assert_same_weights(rebuilt, model)
    assert_same_weights(pretrained.HubVisionTransformer.from_pretrained(str(tmp_path)), model)


def rewrite_weights(directory, change) -> None:
    path = directory / "model.safetensors"
    tensors = safetensors.torch.load_file(str(path))
    change(tensors)
    safetensors.torch.save_file(tensors, str(path))


def test_loading_with_a_missing_weight_fails_naming_it(tmp_path):
    pretrained.HubVisionTransformer(**tiny_config()).save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda tensors: tensors.pop("blocks.1.mlp.fc1.bias"))
    with pytest.raises(ValueError, match=r"missing \['blocks.1.mlp.fc1.bias'\], unexpected \[\]"):
        pretrained.HubVisionTransformer.from_pretrained(str(tmp_path))


def sequential_mlp_names(tensors) -> None:
    """Rename the MLP's weights as checkpoints saved when it was an nn.Sequential name them."""
    for name in [name for name in tensors if ".mlp.fc" in name]:
        tensors[name.replace(".mlp.fc1.", ".mlp.0.").replace(".mlp.fc2.", ".mlp.3.")] = tensors.pop(name)


def test_checkpoints_with_the_sequential_mlp_names_still_load(tmp_path):
    model = randomized(pretrained.HubVisionTransformer(**tiny_config()))
    model.save_pretrained(tmp_path)
    rewrite_weights(tmp_path, sequential_mlp_names)
    assert "blocks.1.mlp.3.weight" in safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    loaded = pretrained.HubVisionTransformer.from_pretrained(str(tmp_path))
    assert_same_weights(loaded, model)
    old_state = dict(model.state_dict())
    sequential_mlp_names(old_state)
    fresh = VisionTransformer(**tiny_config())
    fresh.load_state_dict(old_state)  # strict: every old name lands on today's
    assert_same_weights(fresh, model)


def test_upgrade_state_dict_renames_the_sequential_mlp_layers_only():
    names = {"blocks.0.mlp.0.weight": 1, "blocks.11.mlp.3.bias": 2, "blocks.0.mlp_norm.weight": 3,
             "blocks.0.attention.to_out.0.weight": 4, "blocks.1.mlp.fc1.weight": 5, "head.weight": 6}
    assert upgrade_state_dict(names) == {
        "blocks.0.mlp.fc1.weight": 1, "blocks.11.mlp.fc2.bias": 2, "blocks.0.mlp_norm.weight": 3,
        "blocks.0.attention.to_out.0.weight": 4, "blocks.1.mlp.fc1.weight": 5, "head.weight": 6}
    assert upgrade_state_dict({"module.blocks.2.mlp.3.weight": 0}, prefix="module.") == {
        "module.blocks.2.mlp.fc2.weight": 0}
    assert upgrade_state_dict({"blocks.2.mlp.3.weight": 0}, prefix="module.") == {"blocks.2.mlp.3.weight": 0}


def test_loading_with_an_unexpected_weight_fails_naming_it(tmp_path):
    pretrained.HubVisionTransformer(**tiny_config()).save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda tensors: tensors.update(extra=torch.zeros(2)))
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['extra'\]"):
        pretrained.HubVisionTransformer.from_pretrained(str(tmp_path))


def test_loading_weights_of_another_shape_fails_with_a_value_error(tmp_path):
    pretrained.HubVisionTransformer(**tiny_config()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "embed_dim": 32}))
    with pytest.raises(ValueError, match="do not match the config"):
        pretrained.HubVisionTransformer.from_pretrained(str(tmp_path))


def test_loading_without_config_or_weights_fails(tmp_path):
    pretrained.HubVisionTransformer(**tiny_config()).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="expected weights at .*model.safetensors"):
        pretrained.HubVisionTransformer.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="has no vit_hub config.json"):
        pretrained.HubVisionTransformer.from_pretrained(str(tmp_path))


def test_non_strict_load_is_possible_when_asked(tmp_path):
    pretrained.HubVisionTransformer(**tiny_config()).save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda tensors: tensors.pop("head.bias"))
    model = pretrained.HubVisionTransformer.from_pretrained(str(tmp_path), strict=False)
    assert model.head.bias.shape == (2,)


# Bad inputs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("pixels, error, message", [
    (torch.zeros(1, 1, 16, 16), ValueError, "expected 3 input channels, got 1"),
    (torch.zeros(1, 4, 16, 16), ValueError, "expected 3 input channels, got 4"),
    (torch.zeros(1, 3, 18, 16), ValueError, "divisible by the patch size 4x4, got 18x16"),
    (torch.zeros(1, 3, 16, 15), ValueError, "divisible by the patch size 4x4, got 16x15"),
    (torch.zeros(3, 16, 16), ValueError, r"expected pixel_values of rank 4 \[batch, 3, height, width\], got rank 3"),
    (torch.zeros(1, 1, 3, 16, 16), ValueError, "got rank 5"),
    (torch.zeros(1, 3, 16, 16, dtype=torch.uint8), ValueError, "expected floating-point pixel_values, got torch.uint8"),
    (torch.zeros(1, 3, 16, 16, dtype=torch.int64), ValueError, "got torch.int64"),
    ([[0.0]], TypeError, "expected pixel_values as a torch.Tensor, got list"),
], ids=["1-channel", "4-channels", "height", "width", "rank-3", "rank-5", "uint8", "int64", "list"])
def test_wrong_input_says_what_was_expected_and_found(pixels, error, message):
    model = VisionTransformer(**tiny_config())
    with pytest.raises(error, match=message):
        model(pixels)


@pytest.mark.parametrize("overrides, message", [
    (dict(num_heads=3), "embed_dim 16 is not divisible by num_heads 3"),
    (dict(in_channels=2), "in_channels: expected one of 1, 3, got 2"),
    (dict(image_size=18), "image height 18 is not divisible by patch height 4"),
    (dict(image_size=[16, 18]), "image width 18 is not divisible by patch width 4"),
    (dict(image_size=0), "image_size: expected sides from 1 to 4,096, found 0"),
    (dict(image_size=[16, 16, 16]), r"image_size: expected an int or \[height, width\]"),
    (dict(image_size=10**6), "image_size: expected sides from 1 to 4,096, found 1000000"),
    (dict(image_size=4096, patch_size=2), "expected at most 4,096 patches, found 2048x2048"),
    (dict(patch_size=True), "patch_size: expected an int or a list of ints, found True"),
    (dict(depth=0), "depth: expected an int from 1 to 512, found 0"),
    (dict(depth=10**9), "depth: expected an int from 1 to 512, found 1000000000"),
    (dict(embed_dim=16.0), "embed_dim: expected an int, found 16.0"),
    (dict(embed_dim=10**6), "embed_dim: expected an int from 1 to 16,384, found 1000000"),
    (dict(pos_embedding="rotary"), "pos_embedding: expected one of learned, sincos, got 'rotary'"),
    (dict(pooling="max"), "pooling: expected one of cls, mean, got 'max'"),
    (dict(patch_embedding="overlap"), "patch_embedding: expected one of conv, shifted, convstem, hybrid"),
    (dict(patch_embedding="hybrid", patch_size=[4, 6], image_size=[16, 24]),
     r"patch_embedding hybrid: expected patch sides that are powers of two .*, got patch_size \[4, 6\]"),
    (dict(patch_embedding="convstem", patch_size=[4, 6], image_size=[16, 24]),
     r"patch_embedding convstem: expected patch sides that are powers of two .*, got patch_size \[4, 6\]"),
    (dict(pixel_norm="per-channel"), "pixel_norm: expected one of dataset, image, got 'per-channel'"),
    (dict(num_classes=3), "num_classes 3 does not match the 2 labels given"),
    (dict(labels=None, num_classes=-1), "num_classes: expected an int from 0 to 100,000, found -1"),
    (dict(labels=None, num_classes=10**7), "num_classes: expected an int from 0 to 100,000, found 10000000"),
    (dict(labels=5), "labels: expected a list of strings or null, found 5"),
    (dict(labels=["cat", 3]), r"labels: expected a list of strings or null, found \['cat', 3\]"),
    (dict(layer_norm_eps="x"), "layer_norm_eps: expected a number, found 'x'"),
    (dict(qkv_bias="yes"), "qkv_bias: expected true or false, found 'yes'"),
    (dict(in_channels="3"), "in_channels: expected an int, found '3'"),
    (dict(mean="x"), "mean: expected a number, a list of numbers or null, found 'x'"),
    (dict(mean=[0.1, 0.2]), r"mean: expected 3 values \(one per channel\), got 2"),
    (dict(std=[0.5, 0.0, 0.5]), "std: expected positive values"),
    (dict(dropout=1.0), r"dropout: expected a rate in \[0, 1\), got 1.0"),
    (dict(drop_path=-0.1), r"drop_path: expected a rate in \[0, 1\), got -0.1"),
    (dict(mlp_ratio=-1), "mlp_ratio: expected a positive"),
    (dict(colour="red"), r"unknown config keys \['colour'\]"),
])
def test_bad_config_says_what_was_expected(overrides, message):
    with pytest.raises(ValueError, match=message):
        VisionTransformer(**tiny_config(**overrides))


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown preset 'huge'; expected one of mnist, small-data, tiny"):
        ViTConfig.from_preset("huge")


def test_preset_fields_can_be_overridden_but_none_keeps_them():
    config = ViTConfig.from_preset("mnist", depth=2, embed_dim=None)
    assert (config.depth, config.embed_dim, config.patch_size) == (2, 64, [4, 4])


def test_config_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="expected a vit_hub config.json at"):
        ViTConfig.from_json(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ValueError, match="is not valid JSON"):
        ViTConfig.from_json(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="is not a vit_hub config"):
        ViTConfig.from_json(tmp_path / "config.json")


def test_derived_sizes():
    config = ViTConfig(**tiny_config(image_size=[32, 48], patch_size=[8, 4]))
    assert config.grid_size == (4, 12) and config.num_patches == 48 and config.num_tokens == 49


@pytest.mark.parametrize("num_train, channels, side, expected", [
    (600, 1, 28, dict(image_size=28, patch_size=4, in_channels=1, patch_embedding="convstem", embed_dim=128,
                      dropout=0.1, drop_path=0.1)),
    (400, 3, 500, dict(image_size=64, patch_size=8, in_channels=3, locality_attention=True, embed_dim=192,
                       patch_embedding="hybrid", dropout=0.0, drop_path=0.1)),
    (50_000, 3, 32, dict(image_size=32, patch_size=4, embed_dim=192)),
    (500_000, 3, 300, dict(image_size=224, patch_size=16, embed_dim=192, depth=12)),
])
def test_suggested_architecture_fits_the_data_and_builds(num_train, channels, side, expected):
    values = suggest_for_data(num_train, channels, side)
    assert {key: values[key] for key in expected} == expected
    config = ViTConfig.from_dict(values)
    assert config.grid_size in ((7, 7), (8, 8), (14, 14))


@pytest.mark.parametrize("num_train, side, photos", [
    (400, PHOTO_SIDE, False), (400, PHOTO_SIDE + 1, True),  # a median side of exactly PHOTO_SIDE: not photos
    (SMALL_DATA_IMAGES - 1, 200, True), (SMALL_DATA_IMAGES, 200, False),  # SMALL_DATA_IMAGES: not small
])
def test_small_photo_folders_start_just_above_the_photo_side_and_below_the_small_data_count(num_train, side, photos):
    assert is_small_photo_folder(num_train, side) is photos
    stem = suggest_for_data(num_train, 3, side).get("patch_embedding")
    assert (stem == "hybrid") is photos
