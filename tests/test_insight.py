"""Inside the model (vit_hub/insight/views.py, figures.py, inspect.py): known answers for
every view, each patch embedding, both poolings and positions, the CLI, the card and the app's
tab. Tiny models, offline."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import tiny_config
from vit_hub.cli import main as cli_main
from vit_hub.demo import backends, page
from vit_hub.hub.card import render_card_text
from vit_hub.hub.pretrained import HubVisionTransformer
from vit_hub.insight import inspect as inspecting
from vit_hub.insight import views as insight
from vit_hub.insight.figures import head_grid, view_images
from vit_hub.layout import INSPECT_FIGURES
from vit_hub.model.config import ViTConfig
from vit_hub.model.patches import PatchEmbedding

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "models" / "vit-mnist"
NON_SQUARE = ViTConfig(image_size=[8, 24], patch_size=[4, 8], in_channels=1, embed_dim=16, depth=2, num_heads=2)


def reference_distance(config: ViTConfig) -> float:
    """The mean distance over all ordered pairs of patch centres (self-pairs included), by loops."""
    (grid_h, grid_w), (patch_h, patch_w) = config.grid_size, config.patch_size
    centres = [((r + 0.5) * patch_h, (c + 0.5) * patch_w) for r in range(grid_h) for c in range(grid_w)]
    pairs = list(itertools.product(centres, repeat=2))
    return sum(np.hypot(a[0] - b[0], a[1] - b[1]) for a, b in pairs) / len(pairs)


def attention_of(rows: np.ndarray, depth: int = 2, batch: int = 3, heads: int = 2) -> np.ndarray:
    """One [T, T] attention repeated to [depth, batch, heads, T, T]."""
    return np.broadcast_to(rows, (depth, batch, heads, *rows.shape)).copy()


# 3. Attention distance: known answers ------------------------------------------------------
def test_attention_to_itself_is_at_distance_zero():
    tokens = NON_SQUARE.num_tokens
    self_only = np.eye(tokens)  # every patch to itself; the class token to itself
    self_only[0] = np.eye(tokens)[5]  # the class token to one patch: no spread
    per_query, pooled = insight.attention_distance(attention_of(self_only), NON_SQUARE)
    assert per_query.shape == pooled.shape == (2, 3, 2)
    np.testing.assert_allclose(per_query, 0.0, atol=1e-12)
    np.testing.assert_allclose(pooled, 0.0, atol=1e-12)


def test_uniform_attention_is_at_the_mean_pairwise_distance_of_the_grid():
    tokens = NON_SQUARE.num_tokens  # 2x3 grid of 4x8 patches: not square, neither are the patches
    uniform = np.full((tokens, tokens), 1.0 / tokens)
    per_query, pooled = insight.attention_distance(attention_of(uniform), NON_SQUARE)
    expected = reference_distance(NON_SQUARE)
    np.testing.assert_allclose(per_query, expected, rtol=1e-12)
    np.testing.assert_allclose(pooled, expected, rtol=1e-12)
    assert insight.uniform_distance(NON_SQUARE) == pytest.approx(expected)


def test_random_attention_matches_a_loop_reference():
    config = ViTConfig(**tiny_config(image_size=[12, 16], patch_size=4, pooling="mean"))  # 3x4 grid
    rng = np.random.default_rng(0)
    weights = rng.random((2, 2, 2, config.num_tokens, config.num_tokens))
    weights /= weights.sum(-1, keepdims=True)
    per_query, pooled = insight.attention_distance(weights, config)
    distance = insight.patch_distances(config)
    layer, item, head = 1, 0, 1
    rows = weights[layer, item, head, :, 1:]
    expected = np.mean([sum(rows[q, k] * distance[q - 1, k] for k in range(12)) / rows[q].sum()
                        for q in range(1, 13)])
    assert per_query[layer, item, head] == pytest.approx(expected)
    mean_row = np.mean([rows[q] / rows[q].sum() for q in range(1, 13)], axis=0)  # mean pooling: patch rows
    spread = sum(mean_row[i] * mean_row[j] * distance[i, j] for i in range(12) for j in range(12))
    assert pooled[layer, item, head] == pytest.approx(spread)


def test_locality_attention_of_a_trained_shape_is_measured(tmp_path):
    """LSA masks the diagonal and learns a temperature: distances stay well defined."""
    torch.manual_seed(0)
    model = HubVisionTransformer(**tiny_config(locality_attention=True, pooling="mean")).eval()
    pixels = torch.randn(3, 3, 16, 16).numpy()
    per_query, pooled = insight.mean_attention_distance(insight.torch_attend(model), pixels, model.config)
    assert per_query.shape == pooled.shape == (2, 2)
    largest = insight.patch_distances(model.config).max()
    assert np.all((per_query > 0) & (per_query <= largest)) and np.all((pooled >= 0) & (pooled <= largest))
    # No attention to itself: a head that looks nowhere in particular is beyond the uniform distance.
    masked = 1.0 - np.eye(model.config.num_tokens)
    per_query, _ = insight.attention_distance(attention_of(masked / masked.sum(-1, keepdims=True)), model.config)
    assert np.all(per_query > insight.uniform_distance(model.config))


def test_attentions_of_the_wrong_size_are_refused():
    with pytest.raises(ValueError, match=r"expected attentions \[\.\.\., 7, 7\].*got shape \[2, 1, 2, 5, 5\]"):
        insight.attention_distance(np.ones((2, 1, 2, 5, 5)), NON_SQUARE)


# 2. Position similarity ---------------------------------------------------------------------
def test_sincos_positions_are_the_models():
    """The torch-free table the views measure is the one the model adds to its patch tokens."""
    model = HubVisionTransformer(**tiny_config(image_size=[12, 20], embed_dim=32, pos_embedding="sincos"))  # 3x5
    table = insight.position_table(None, model.config)
    assert table.shape == (15, 32)
    np.testing.assert_array_equal(table, model.pos_embedding[0].numpy())


def test_sincos_similarity_is_one_on_the_diagonal_and_falls_off_with_distance():
    config = ViTConfig(image_size=[24, 32], patch_size=4, in_channels=1, embed_dim=64, depth=1, num_heads=2,
                       pos_embedding="sincos")  # 6x8 grid
    similarity = insight.position_similarity(insight.position_table(None, config))
    assert similarity.shape == (48, 48)
    np.testing.assert_allclose(np.diag(similarity), 1.0, atol=1e-12)
    np.testing.assert_allclose(similarity, similarity.T, atol=1e-12)
    steps = insight.patch_distances(config) / 4  # grid steps between patches
    by_distance = [similarity[np.isclose(steps, d)].mean() for d in (1, 2, 3, 4)]
    assert all(near > far for near, far in zip(by_distance, by_distance[1:])), by_distance


def test_learned_positions_come_from_the_weights_or_say_they_need_them():
    torch.manual_seed(0)
    model = HubVisionTransformer(**tiny_config(image_size=[16, 24]))  # learned positions, 4x6 grid
    weights = insight.torch_weights(model)
    table = insight.position_table(weights, model.config)
    np.testing.assert_allclose(table, model.pos_embedding[0].detach().numpy(), atol=1e-7)
    views = insight.compute_views(model.config, None)
    assert views.similarity is None and "need the model's weights" in views.position_note
    assert views.report()["position_similarity"] is None
    with pytest.raises(ValueError, match=r"pos_embedding of shape \[1, 24, 16\].*found shape \[1, 20, 16\]"):
        insight.position_table({"pos_embedding": np.zeros((1, 20, 16))}, model.config)


# 1. Patch filters ----------------------------------------------------------------------------
def test_pca_recovers_known_directions_orthonormal_with_shares_summing_to_at_most_one():
    rng = np.random.default_rng(0)
    basis, _ = np.linalg.qr(rng.normal(size=(12, 12)))  # orthonormal directions as columns
    scales = np.array([5.0, 3.0, 1.0] + [0.01] * 9)
    rows = (rng.normal(size=(4000, 12)) * scales) @ basis.T + 7.0  # an offset the centring removes
    components, shares = insight.principal_components(rows, 5)
    assert components.shape == (5, 12) and shares.shape == (5,)
    np.testing.assert_allclose(components @ components.T, np.eye(5), atol=1e-10)
    assert shares.sum() <= 1.0 and np.all(np.diff(shares) <= 0)
    np.testing.assert_allclose(shares[:3], scales[:3] ** 2 / (scales**2).sum(), rtol=0.1)
    for index in range(3):
        assert abs(components[index] @ basis[:, index]) > 0.99


def test_shifted_filters_are_the_linear_map_on_the_image():
    """The window filter applied to the image gives the shifted projection's tokens (inside the image)."""
    torch.manual_seed(0)
    embedding = PatchEmbedding(in_channels=3, embed_dim=8, patch_size=[4, 4], shifted=True)
    image = torch.randn(1, 3, 16, 16)
    shifted = torch.cat([image, *embedding._diagonal_shifts(image)], dim=1)
    tokens = embedding.to_tokens(shifted)[0].detach().numpy()  # [D, 4, 4], before the LayerNorm
    window = insight.shifted_window(embedding.to_tokens.weight.detach().numpy(), 3)  # [D, 3, 8, 8]
    assert window.shape == (8, 3, 8, 8)
    row, col = 1, 2  # an interior patch: its window lies inside the image
    pixels = image[0, :, 4 * row - 2:4 * row + 6, 4 * col - 2:4 * col + 6].numpy()
    expected = (window * pixels).sum(axis=(1, 2, 3)) + embedding.to_tokens.bias.detach().numpy()
    np.testing.assert_allclose(tokens[:, row, col], expected, atol=1e-5)


@pytest.mark.parametrize("kind, channels, side", [("conv", 3, 4), ("shifted", 3, 8), ("shifted", 1, 8)])
def test_filters_of_linear_patch_embeddings(kind, channels, side):
    torch.manual_seed(0)
    model = HubVisionTransformer(**tiny_config(patch_embedding=kind, in_channels=channels))
    filters = insight.patch_filters(insight.torch_weights(model), model.config, count=6)
    assert filters.components.shape == (6, channels, side, side)
    flat = filters.components.reshape(6, -1)
    np.testing.assert_allclose(flat @ flat.T, np.eye(6), atol=1e-8)
    assert 0 < filters.variance.sum() <= 1.0
    assert ("shifted" in filters.note) == (kind == "shifted")


def test_a_conv_stem_has_no_patch_filter_and_says_so():
    model = HubVisionTransformer(**tiny_config(patch_embedding="convstem"))
    views = insight.compute_views(model.config, insight.torch_weights(model))
    report = views.report()
    assert report["patch_filter_variance"] is None
    assert "convolutional stem" in report["patch_filter_note"] and "does not apply" in report["patch_filter_note"]
    assert report["readings"]["patch_filters"].startswith("Not shown: this model has a convolutional stem")


def test_weights_that_do_not_fit_the_config_are_refused_in_one_line():
    config = ViTConfig(**tiny_config())
    with pytest.raises(ValueError, match=r"patch_embedding.to_tokens.weight of shape \[16, 3, 4, 4\].*"
                                         r"found shape \[16, 3, 2, 2\]"):
        insight.patch_filters({insight.PATCH_WEIGHT: np.zeros((16, 3, 2, 2))}, config)


# 4. Per-head maps ----------------------------------------------------------------------------
def test_head_maps_read_the_pooled_row_per_head():
    tokens = NON_SQUARE.num_tokens
    rows = np.full((tokens, tokens), 1.0 / tokens)
    rows[0] = np.eye(tokens)[6]  # the class token looks at the last patch only
    maps = insight.head_maps(attention_of(rows, batch=1), NON_SQUARE)
    assert maps.shape == (2, 1, 2, 2, 3)
    assert maps[0, 0, 0, 1, 2] == 1.0 and maps[0, 0, 0].sum() == 1.0
    mean_config = ViTConfig(**{**NON_SQUARE.to_dict(), "pooling": "mean"})
    mean_pooled = insight.head_maps(attention_of(rows, batch=1), mean_config)
    assert not mean_pooled.any()  # the patch tokens look everywhere alike: no patch stands out
    grid = head_grid(Image.new("L", (24, 8)), maps[:, 0], tile_height=20)
    assert grid.size == (2 * 30 + 3, 2 * 20 + 3)  # 2 heads x 2 layers of 2x3 patches, 10 px each


# The CLI, the card, training -----------------------------------------------------------------
@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for index in range(5):
        Image.fromarray(rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)).save(folder / f"{index}.png")
    return folder


def saved(tmp_path: Path, **overrides) -> Path:
    torch.manual_seed(0)
    HubVisionTransformer(**tiny_config(**overrides)).save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_cli_writes_the_figures_and_the_numbers(tmp_path, images, capsys):
    model_dir = saved(tmp_path, image_size=[16, 24], pooling="mean")  # 4x6 grid, learned positions
    assert cli_main(["inspect", "--model", str(model_dir), "--data", str(images), "--out", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"wrote inspect.json, patch_filters.png, position_similarity.png, attention_distance.png "
                     f"to {tmp_path / 'out'}"]
    report = json.loads((tmp_path / "out" / "inspect.json").read_text())
    assert np.array(report["mean_attention_distance"]).shape == (2, 2)  # [depth][heads]
    assert np.array(report["pooled_attention_distance"]).shape == (2, 2)
    assert report["pooled_token"].startswith("mean of the patch tokens")
    assert np.array(report["position_similarity"]).shape == (24, 24)
    assert 0 < sum(report["patch_filter_variance"]) <= 1.0
    assert report["data"].startswith("5 images from images")
    for name in INSPECT_FIGURES:
        assert (tmp_path / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--data", "NOWHERE"], "--data: expected a folder of images"),
    (["--data", "{images}", "--samples", "0"], "--samples: expected at least one image, got 0"),
    ([], "inspect: expected --data"),  # no default data: not a digit model, and no samples/ of its own
])
def test_cli_bad_input_is_one_line(tmp_path, images, capsys, args, message):
    model_dir = saved(tmp_path)
    args = [arg.format(images=images) for arg in args]
    assert cli_main(["inspect", "--model", str(model_dir), "--out", str(tmp_path / "out"), *args]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error and "Traceback" not in error


def test_a_photo_model_without_data_is_measured_on_its_own_samples(tmp_path, capsys):
    """No --data: a model that is not of digits is measured on the samples/ its model dir keeps
    (those training wrote), and the app's Inside tab on the same images."""
    from vit_hub.data.samples import write_samples

    model_dir = saved(tmp_path)  # RGB, labels not digits
    photos = [(Image.fromarray(np.full((20, 30, 3), 40 * index, np.uint8)), index % 2) for index in range(5)]
    write_samples(photos, ["cat", "dog"], model_dir)
    assert cli_main(["inspect", "--model", str(model_dir), "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "inspect.json").read_text())
    assert report["data"] == "5 of the model's own sample images"
    views = page.model_views(backends.TorchPredictor.load(model_dir, threads=None))
    assert views.report()["data"] == "5 of the model's own sample images"


def test_card_shows_the_views_with_their_readings(tmp_path, images):
    model_dir = saved(tmp_path, patch_embedding="convstem")
    pixels, source = inspecting.load_pixels(images, ViTConfig.from_json(model_dir / "config.json"))
    model = HubVisionTransformer.from_pretrained(model_dir)
    views = insight.compute_views(model.config, inspecting.read_weights(model_dir), insight.torch_attend(model),
                                  pixels, source)
    inspecting.write_views(views, model_dir)
    card = render_card_text(model_dir)
    assert "## Inside the model" in card and "![attention distance](attention_distance.png)" in card
    assert "Layer 1's heads attend" in card and "Not shown: this model has a convolutional stem" in card


def test_training_writes_the_views_into_the_model_dir(tmp_path, split_image_folder):
    from conftest import TINY_TRAIN_FLAGS

    out = tmp_path / "run"
    assert cli_main(["train", "--data", str(split_image_folder), "--out", str(out), "--epochs", "1",
                     "--patch-embedding", "conv", *TINY_TRAIN_FLAGS]) == 0
    report = json.loads((out / "inspect.json").read_text())
    assert report["data"].endswith("validation images") and len(report["mean_attention_distance"]) == 1
    assert all((out / name).is_file() for name in INSPECT_FIGURES)
    assert "![patch filters](patch_filters.png)" in (out / "README.md").read_text()


# The app -------------------------------------------------------------------------------------
def test_the_app_tab_with_onnx_only_says_the_filters_need_the_weights(tmp_path):
    """A model dir with the ONNX graphs and config but no model.safetensors: the tab says so; the
    views that need no weights (sin-cos positions, attention distances) are still drawn."""
    assert (BUNDLED / "model_attentions.onnx").is_file(), f"{BUNDLED} ships no model_attentions.onnx"
    folder = tmp_path / "onnx-only"
    folder.mkdir()
    for name in ("config.json", "model.onnx", "model_attentions.onnx"):
        shutil.copy(BUNDLED / name, folder / name)
    predictor = backends.OnnxPredictor.load(folder)
    assert predictor.weights() is None
    views = page.model_views(predictor)
    readings = views.readings()
    assert readings["patch_filters"] == ("Not shown: the filters need the model's weights (model.safetensors), "
                                         "which this backend does not have.")
    assert views.similarity is not None and views.distance.shape == (6, 4)
    assert set(view_images(views)) == set(page.INSIDE_TITLES)


def test_figures_leave_pyplot_alone(tmp_path):
    """Library figures are plain matplotlib Figures: importing and drawing them never loads
    pyplot, whose global state and backend belong to the caller (a notebook keeps its own)."""
    script = (
        "import sys\n"
        "from vit_hub.insight import figures as insight_figures\n"
        "from vit_hub.train import report as plots, sweep\n"
        f"plots.plot_curves([{{'epoch': 1, 'train_loss': 1.0, 'train_accuracy': 0.5}}], {str(tmp_path / 'c.png')!r})\n"
        f"plots.plot_confusion_matrix([[2, 1], [0, 3]], ['a', 'b'], {str(tmp_path / 'm.png')!r})\n"
        "insight_figures.figure_image(insight_figures._note_figure('t', 'n'))\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert Image.open(tmp_path / "c.png").size[0] > 0 and Image.open(tmp_path / "m.png").size[0] > 0


def test_the_analyses_and_figures_need_no_torch():
    """The views are measured and drawn beside the app's torch-free ONNX backend (a Space)."""
    script = ("import sys\nfrom vit_hub.insight import figures, views\n"
              "assert 'torch' not in sys.modules, 'torch imported'\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_distance_reading_says_each_thing_once():
    """One value for a span that rounds alike; global early and late layers in one clause; no
    "tokens's" for a mean-pooled model."""
    config = ViTConfig(**tiny_config(image_size=16, patch_size=4, depth=2, pooling="mean"))
    uniform = insight.uniform_distance(config)
    distance = np.full((2, 2), uniform)  # [depth, heads]: every head as far as uniform attention
    text = insight.read_distances(distance, np.full((2, 2), 3.0), config, "test images")
    assert f"attend {uniform:.1f} px away" in text and " to " not in text.split("(")[0]
    assert text.count("global") == 1 and "every head is global" in text
    assert "The attention of the mean of the patch tokens spreads" in text and "'s attention" not in text


def test_a_card_fine_tuned_in_its_own_folder_says_so_and_names_the_architecture_once(tmp_path):
    from vit_hub.hub.pretrained import HubVisionTransformer

    model_dir = tmp_path / "again"
    HubVisionTransformer(**tiny_config()).save_pretrained(model_dir)
    source = {"kind": "fine-tuned", "source": str(model_dir), "revision": None, "hub": False, "library": "vit_hub",
              "architecture": "vit_hub ViT", "license": "mit", "num_classes": 2, "notes": []}
    (model_dir / "source.json").write_text(json.dumps(source))
    text = render_card_text(model_dir)
    assert "fine-tuned with vit_hub from its own earlier weights (vit_hub ViT)" in text
    assert "vit_hub vit_hub" not in text and "github.com" not in text
