"""`vit-hub import`: timm and transformers ViTs, built here with random weights and
saved as each library publishes them, converted and compared with the library itself.
Offline: one of them is served by the local test Hub (tests/hub_double.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import timm  # timm and transformers are test dependencies: a missing one fails, never skips
import torch
import transformers
from huggingface_hub import HfApi
from PIL import Image
from timm.utils.attention_extract import AttentionExtract

from tests.hub_double import HubDouble, serving_hub
from vit_hub.cli import main
from vit_hub.demo import backends, page, pictures
from vit_hub.hub.pretrained import load_model

TOKEN = "hf_vitHubImportToken0123456789abcdef"
TOLERANCE = 1e-4  # max |vit_hub - source| in fp32, logits and attentions


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every weight moved by noise, so that a norm, bias or position mapped to the wrong place
    changes the output (fresh inits leave norms at 1, biases at 0 and the head near 0)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.eval()


def pixels(config, batch: int = 2, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, config.in_channels, *config.image_size, generator=generator)  # [B, C, H, W]


def ours(model_dir: Path, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, attentions [depth, B, heads, T, T]) of the imported vit_hub model."""
    model = load_model(model_dir)
    with torch.no_grad():
        logits, attentions = model(images, output_attentions=True)
    return logits, torch.stack(list(attentions))


def timm_outputs(model: torch.nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """timm's logits, and its attention maps as timm's own AttentionExtract reads them."""
    for block in model.blocks:
        block.attn.fused_attn = False  # the explicit softmax path, whose attn_drop sees the maps
    with torch.no_grad():
        logits = model(images)
        maps = AttentionExtract(model, method="hook")(images)
    return logits, torch.stack(list(maps.values()))


def save_timm(model: torch.nn.Module, folder: Path) -> Path:
    timm.models.save_for_hf(model, folder, safe_serialization=True)  # config.json + model.safetensors
    return folder


def import_into(source: str | Path, out: Path) -> Path:
    assert main(["import", str(source), "--out", str(out)]) == 0
    return out


# timm -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def timm_tiny(tmp_path_factory):
    """timm's vit_tiny_patch16_224 (ViT-Ti/16, 224 px, 1000 ImageNet classes), random weights."""
    torch.manual_seed(0)
    model = perturbed(timm.create_model("vit_tiny_patch16_224", pretrained=False))
    return model, save_timm(model, tmp_path_factory.mktemp("timm_tiny"))


def test_timm_vit_tiny_imports_with_the_same_logits_and_attentions(timm_tiny, tmp_path, capsys):
    model, folder = timm_tiny
    out = import_into(folder, tmp_path / "imported")
    assert "timm vit_tiny_patch16_224.augreg_in21k_ft_in1k" in capsys.readouterr().out
    images = pixels(load_model(out).config)
    logits, attentions = ours(out, images)
    expected_logits, expected_attentions = timm_outputs(model, images)
    assert attentions.shape == expected_attentions.shape == (12, 2, 3, 197, 197)
    assert (logits - expected_logits).abs().max() <= TOLERANCE
    assert (attentions - expected_attentions).abs().max() <= TOLERANCE

    config = json.loads((out / "config.json").read_text())
    assert (config["image_size"], config["patch_size"], config["embed_dim"], config["num_heads"]) == (
        [224, 224], [16, 16], 192, 3)
    assert config["class_token_position"] and config["interpolation"] == "bicubic"
    assert config["mean"] == config["std"] == [0.5, 0.5, 0.5]
    assert config["labels"][:2] == ["tench, Tinca tinca", "goldfish, Carassius auratus"]  # tag says in1k
    card = (out / "README.md").read_text()
    assert "license: apache-2.0" in card and "converted with" in card and "crop_pct 0.9" in card


@pytest.mark.parametrize("size, args", [
    ((96, 160), dict(num_classes=7)),  # non-square, non-224, another head
    ((64, 64), dict(num_classes=0, no_embed_class=True, qkv_bias=False)),  # no head, patch-only positions
], ids=["non-square-7-classes", "features-only"])
def test_timm_variants_import_with_the_same_outputs(tmp_path, size, args):
    torch.manual_seed(1)
    model = perturbed(timm.create_model("vit_tiny_patch16_384", pretrained=False, img_size=size, **args), seed=1)
    out = import_into(save_timm(model, tmp_path / "source"), tmp_path / "imported")
    config = load_model(out).config
    assert config.image_size == list(size) and config.num_classes == args["num_classes"]
    images = pixels(config)
    logits, attentions = ours(out, images)
    expected_logits, expected_attentions = timm_outputs(model, images)
    assert logits.shape == expected_logits.shape
    assert (logits - expected_logits).abs().max() <= TOLERANCE
    assert (attentions - expected_attentions).abs().max() <= TOLERANCE


# transformers ---------------------------------------------------------------------------------
def tiny_vit_config(**overrides):
    values = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96, image_size=32,
                  patch_size=8, num_labels=3, id2label={0: "cat", 1: "dog", 2: "fox"},
                  label2id={"cat": 0, "dog": 1, "fox": 2}, attn_implementation="eager")
    values.update(overrides)
    return transformers.ViTConfig(**values)


@pytest.fixture(scope="module")
def hf_classifier(tmp_path_factory):
    """A small transformers ViTForImageClassification (3 labels, 32 px) with its image processor."""
    torch.manual_seed(2)
    model = perturbed(transformers.ViTForImageClassification(tiny_vit_config()), seed=2)
    folder = tmp_path_factory.mktemp("hf_classifier")
    model.save_pretrained(folder, safe_serialization=True)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}, resample=3, image_mean=[0.4, 0.5, 0.6],
                                   image_std=[0.2, 0.25, 0.3]).save_pretrained(folder)
    return model, folder


def test_transformers_classifier_imports_with_the_same_logits_and_attentions(hf_classifier, tmp_path):
    model, folder = hf_classifier
    out = import_into(folder, tmp_path / "imported")
    config = load_model(out).config
    assert config.labels == ["cat", "dog", "fox"] and config.layer_norm_eps == 1e-12
    assert (config.interpolation, config.mean, config.std) == ("bicubic", [0.4, 0.5, 0.6], [0.2, 0.25, 0.3])
    images = pixels(config)
    logits, attentions = ours(out, images)
    with torch.no_grad():
        expected = model(pixel_values=images, output_attentions=True)
    assert (logits - expected.logits).abs().max() <= TOLERANCE
    assert (attentions - torch.stack(expected.attentions)).abs().max() <= TOLERANCE


def test_transformers_vit_model_imports_as_features_with_its_pooler(tmp_path):
    torch.manual_seed(3)
    model = perturbed(transformers.ViTModel(tiny_vit_config(image_size=[32, 48])), seed=3)
    model.save_pretrained(tmp_path / "source", safe_serialization=True)
    out = import_into(tmp_path / "source", tmp_path / "imported")
    imported = load_model(out)
    assert (imported.config.num_classes, imported.config.pre_logits) == (0, 48)
    images = pixels(imported.config)
    with torch.no_grad():
        expected = model(pixel_values=images)
        features = imported(images).logits  # no head: the pre-logits (pooler) output
        tokens, _ = imported.forward_features(images, output_attentions=True)
    assert (features - expected.pooler_output).abs().max() <= TOLERANCE
    assert (tokens - expected.last_hidden_state).abs().max() <= TOLERANCE
    with pytest.raises(ValueError, match="without a head .* vit-hub train --init"):
        imported.config.check_has_head("predict")
    from vit_hub.model.flops import layer_rows

    # vit-hub info's rows hold every weight, the class token's position and the pooler included
    assert sum(parameters for _, parameters, _ in layer_rows(imported)) == sum(p.numel() for p in imported.parameters())
    assert "| classes | none: no head, the output is the pooled features |" in (out / "README.md").read_text()


# Through the (local test) Hub ------------------------------------------------------------------
@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The local Hub double with a token, a fresh cache, and both clients pointed at it."""
    with serving_hub(monkeypatch, tmp_path / "hf-cache", TOKEN) as double:
        yield double


def publish(folder: Path, repo_id: str, hub: HubDouble) -> None:
    """Upload a folder as one commit, as a library's push_to_hub does."""
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo(repo_id)
    api.upload_folder(repo_id=repo_id, folder_path=folder)


def test_a_timm_model_published_as_timm_does_imports_from_the_hub(timm_tiny, hub, tmp_path):
    model, folder = timm_tiny
    publish(folder, "timm/vit_tiny_test", hub)  # timm's save_for_hf files, plus the card timm writes
    hub.put_file("timm/vit_tiny_test", "README.md", timm.models._hub.generate_readme({}, "vit_tiny_test").encode())
    out = import_into("timm/vit_tiny_test", tmp_path / "imported")
    images = pixels(load_model(out).config, batch=1)
    assert (ours(out, images)[0] - timm_outputs(model, images)[0]).abs().max() <= TOLERANCE
    source = json.loads((out / "source.json").read_text())
    assert (source["source"], source["hub"], source["license"]) == ("timm/vit_tiny_test", True, "apache-2.0")
    assert len(source["revision"]) == 40  # the commit the snapshot came from
    assert "base_model: timm/vit_tiny_test" in (out / "README.md").read_text()


def test_a_repo_with_only_a_pickle_is_refused_in_one_line(hub, tmp_path, capsys):
    source = write_source(tmp_path / "source", {"model_type": "vit", "architectures": ["ViTModel"]}, None)
    (source / "pytorch_model.bin").write_bytes(b"a pickle would run code here")
    publish(source, "google/vit-pickle", hub)
    assert main(["import", "google/vit-pickle", "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "only as a pickle (pytorch_model.bin)" in error
    assert not any("pytorch_model.bin" in request and request.startswith("GET") for request in hub.requests)


# What is refused ------------------------------------------------------------------------------
def write_source(folder: Path, config: dict, weights: dict[str, torch.Tensor] | None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if weights is not None:
        safetensors.torch.save_file(weights, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("build, message", [
    (lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, reg_tokens=4, num_classes=2,
                               img_size=32, depth=1), r"register tokens \(reg_token\)"),
    (lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, init_values=1e-5, num_classes=2,
                               img_size=32, depth=1), r"LayerScale \(blocks.0.ls1.gamma\)"),
    (lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, global_pool="avg", num_classes=2,
                               img_size=32, depth=1), r"pools with 'avg'"),
    (lambda: timm.create_model("resnet18", pretrained=False, num_classes=2), "is timm's resnet18, not one of its ViTs"),
], ids=["registers", "layerscale", "avg-pool", "resnet"])
def test_unknown_timm_variants_are_refused_naming_what_was_found(tmp_path, capsys, build, message):
    source = save_timm(build(), tmp_path / "source")
    assert main(["import", str(source), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("error: ")
    assert re.search(message, error), error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config, message", [
    ({"model_type": "deit", "architectures": ["DeiTForImageClassification"]},
     "is a transformers 'deit' model \\(DeiTForImageClassification\\), not a ViT"),
    ({"model_type": "vit", "architectures": ["ViTForImageClassification"]},
     "expected model.safetensors beside config.json, found none"),
    ({"_name_or_path": "x", "hidden_size": 8}, "neither timm's 'architecture' nor transformers' 'model_type'"),
])
def test_other_models_are_refused_in_one_line(tmp_path, capsys, config, message):
    source = write_source(tmp_path / "source", config, None)
    assert main(["import", str(source), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and re.search(message, error), error


def test_a_local_pickle_is_refused_and_never_read(tmp_path, capsys):
    source = write_source(tmp_path / "source", {"model_type": "vit"}, None)
    (source / "pytorch_model.bin").write_bytes(b"a pickle would run code here")
    assert main(["import", str(source), "--out", str(tmp_path / "out")]) == 2
    assert "reads model.safetensors only" in capsys.readouterr().err


def test_import_into_a_model_dir_is_refused(hf_classifier, tmp_path, capsys):
    _, folder = hf_classifier
    out = import_into(folder, tmp_path / "imported")
    assert main(["import", str(folder), "--out", str(out)]) == 2
    assert "expected a new or empty folder" in capsys.readouterr().err


def test_predict_ranks_the_labels_of_an_imported_model(hf_classifier, tmp_path):
    """predict ranks the source's labels, preprocessing as its image processor does: an image of
    another size gives the processor's pixels (its size, bicubic resampling, mean and std) and
    the source model's probabilities. The two resizes round a few pixels to the neighbouring
    8-bit level; a wrong filter, mean or std moves most pixels by tens of levels."""
    from vit_hub.hub.pretrained import predict_images
    from vit_hub.processing.preprocess import preprocess

    source, folder = hf_classifier
    model = load_model(import_into(folder, tmp_path / "imported"))
    image = (np.random.default_rng(0).random((40, 50, 3)) * 255).astype(np.uint8)
    processor = transformers.ViTImageProcessor.from_pretrained(folder)
    expected = processor(images=Image.fromarray(image), return_tensors="pt").pixel_values  # [1, 3, 32, 32]
    ours = preprocess(image, model.config)
    assert ours.shape == tuple(expected.shape[1:]) == (3, 32, 32)
    levels = np.abs(ours - expected[0].numpy()) * np.array([0.2, 0.25, 0.3])[:, None, None] * 255  # in 8-bit steps
    assert levels.max() < 1.001 and (levels > 0.5).mean() < 0.01, (levels.max(), (levels > 0.5).mean())
    [ranked] = predict_images(model, [image], top_k=3)
    assert sorted(label for label, _ in ranked) == ["cat", "dog", "fox"]
    assert abs(sum(probability for _, probability in ranked) - 1) < 1e-5
    with torch.no_grad():
        probabilities = source(pixel_values=expected).logits.softmax(-1)[0]
    for label, probability in ranked:
        assert abs(probability - probabilities[source.config.label2id[label]].item()) < 1e-3


# ONNX, rollout and the app on imported models -------------------------------------------------
def test_imported_models_export_to_onnx_with_parity(hf_classifier, tmp_path):
    """As every export: logits within 1e-4 and attentions within 1e-5 of torch, or export raises."""
    from vit_hub.export import OnnxClassifier, export_onnx

    _, folder = hf_classifier
    imported = import_into(folder, tmp_path / "imported")
    graph = export_onnx(imported, tmp_path / "onnx", output_attentions=True)
    report = json.loads((graph.parent / "model_export_report.json").read_text())
    assert all(section["passed"] for section in report["graphs"].values())
    image = (np.random.default_rng(1).random((32, 32, 3)) * 255).astype(np.uint8)
    onnx_ranked = OnnxClassifier(graph, providers="cpu").predict(image, top_k=3)
    torch_ranked = predict_top3(load_model(imported), image)
    assert [label for label, _ in onnx_ranked] == [label for label, _ in torch_ranked]
    assert np.allclose([p for _, p in onnx_ranked], [p for _, p in torch_ranked], atol=1e-4)


def predict_top3(model, image) -> list[tuple[str, float]]:
    from vit_hub.hub.pretrained import predict_images

    return predict_images(model, [image], top_k=3)[0]


def test_the_app_explains_an_imported_timm_model(timm_tiny, tmp_path):
    """Top-k of the ImageNet labels and a rollout over a 14x14 patch grid, through the app's own path."""
    _, folder = timm_tiny
    threads = torch.get_num_threads()
    predictor = backends.TorchPredictor.load(import_into(folder, tmp_path / "imported"))
    try:
        page.build_demo(predictor)
        photo = Image.fromarray((np.random.default_rng(2).random((180, 240, 3)) * 255).astype(np.uint8))
        result = pictures.explain(predictor, photo, "mean", 0.5, 5)
    finally:
        torch.set_num_threads(threads)
    assert len(result.scores) == 5 and set(result.scores) <= set(predictor.config.labels)
    assert result.overlay.size == pictures.display_size(*photo.size)
    assert result.model_input.size[0] >= 224 and result.heads.size[0] > 0


def test_rollout_of_an_imported_model_covers_its_patch_grid(timm_tiny, tmp_path):
    from vit_hub.explain.rollout import attention_rollout

    _, folder = timm_tiny
    model = load_model(import_into(folder, tmp_path / "imported"))
    with torch.no_grad():
        _, attentions = model(pixels(model.config, batch=2), output_attentions=True)
    maps = attention_rollout(attentions, grid_size=model.config.grid_size)
    assert maps.shape == (2, 14, 14) and np.isfinite(maps).all() and maps.max() == pytest.approx(1.0)


# Fine-tuning from imported weights (vit-hub train --init) ---------------------------------------
FAST_TRAIN = ["--epochs", "2", "--batch-size", "8", "--workers", "0", "--device", "cpu", "--augment", "none"]


@pytest.fixture(scope="module")
def timm_small_grid(tmp_path_factory):
    """A timm ViT at 32 px with 8 px patches (a 4x4 grid), 10 classes, saved as timm does."""
    torch.manual_seed(4)
    model = perturbed(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                                        depth=2, num_classes=10), seed=4)
    return model, save_timm(model, tmp_path_factory.mktemp("timm_small_grid"))


def test_train_init_fine_tunes_a_timm_model_on_a_folder(timm_small_grid, split_image_folder, tmp_path, capsys):
    model, source = timm_small_grid
    out = tmp_path / "run"
    assert main(["train", "--init", str(source), "--data", str(split_image_folder), "--out", str(out),
                 "--image-size", "48", *FAST_TRAIN]) == 0
    printed = capsys.readouterr().out
    assert f"init: timm vit_tiny_patch16_224.augreg_in21k_ft_in1k from {source}" in printed
    assert "lr 2.5e-05" in printed  # the fine-tuning rate, 1e-4 x sqrt(8 / 128)
    tuned = load_model(out)
    config = tuned.config
    assert config.labels == ["bright_disc", "dark_square"] and config.image_size == [48, 48]
    assert (config.embed_dim, config.depth, config.class_token_position, config.interpolation) == (192, 2, True, "bicubic")
    assert tuned.pos_embedding.shape == (1, 36, 192)  # a 6x6 grid now
    record = json.loads((out / "source.json").read_text())
    assert (record["kind"], record["source"]) == ("fine-tuned", str(source))
    card = (out / "README.md").read_text()
    assert "fine-tuned with vit_hub from timm" in card and "vit_tiny_patch16_224" in card and "license: apache-2.0" in card

    # the same folder overwritten by a run from scratch no longer claims a pretrained start
    assert main(["train", "--data", str(split_image_folder), "--out", str(out), "--overwrite", "--image-size", "16",
                 "--patch-size", "4", "--embed-dim", "16", "--depth", "1", "--num-heads", "2", *FAST_TRAIN]) == 0
    assert not (out / "source.json").exists() and "trained from scratch" in (out / "README.md").read_text()


def test_init_weights_keep_the_body_resize_positions_as_timm_does_and_zero_the_head(timm_small_grid):
    from timm.layers import resample_abs_pos_embed

    from vit_hub.hub.fine_tune import fine_tune_config, fine_tune_weights
    from vit_hub.hub.import_model import load_init

    model, source = timm_small_grid
    start = load_init(source)
    config = fine_tune_config(start, ["a", "b", "c"], {"image_size": 48})
    weights = fine_tune_weights(start, config)
    expected = resample_abs_pos_embed(model.pos_embed.detach(), (6, 6), (4, 4), num_prefix_tokens=1)
    assert torch.allclose(weights["pos_embedding"], expected[:, 1:], atol=1e-6)
    assert torch.equal(weights["cls_position"], model.pos_embed.detach()[:, :1])
    assert torch.equal(weights["blocks.1.mlp.fc2.weight"], model.blocks[1].mlp.fc2.weight.detach())
    assert weights["head.weight"].shape == (3, 192) and not weights["head.weight"].any()


def test_init_on_the_model_s_own_labels_keeps_its_head():
    """Trained further on the same labels in the same order, the model keeps its head (a zero
    head would throw away the answer it already gives); other labels, or the same ones in
    another order, get the zero head."""
    from vit_hub.hub.fine_tune import fine_tune_config, fine_tune_weights
    from vit_hub.hub.import_model import load_init

    start = load_init(Path(__file__).resolve().parents[1] / "models" / "vit-mnist")
    same = fine_tune_weights(start, fine_tune_config(start, list("0123456789"), {"canonicalize": "digit"}))
    assert torch.equal(same["head.weight"], start.weights["head.weight"]) and same["head.weight"].any()
    assert torch.equal(same["head.bias"], start.weights["head.bias"])
    for labels in (list("9876543210"), list("01234")):
        other = fine_tune_weights(start, fine_tune_config(start, labels, {}))
        assert other["head.weight"].shape == (len(labels), 64) and not other["head.weight"].any()


def test_init_from_a_vit_model_drops_its_pooler(tmp_path):
    from vit_hub.hub.fine_tune import fine_tune_config
    from vit_hub.hub.import_model import load_init

    transformers.ViTModel(tiny_vit_config()).save_pretrained(tmp_path / "source", safe_serialization=True)
    start = load_init(tmp_path / "source")
    assert start.config.pre_logits == 48
    assert fine_tune_config(start, ["a", "b"], {}).pre_logits == 0  # the ViT paper replaces the whole head


def test_canonicalisation_is_the_new_data_s_choice_when_fine_tuning():
    """None by default, even from a digit model; `--canonicalize digit` keeps it (the bundled
    model is fine-tuned that way; without the flag a run from it trains on raw digits)."""
    from vit_hub.hub.fine_tune import fine_tune_config
    from vit_hub.hub.import_model import load_init

    start = load_init(Path(__file__).resolve().parents[1] / "models" / "vit-mnist")
    assert start.config.canonicalize == "digit"
    assert fine_tune_config(start, list("0123456789"), {}).canonicalize == "none"
    assert fine_tune_config(start, list("0123456789"), {"canonicalize": "digit"}).canonicalize == "digit"


@pytest.mark.parametrize("flags, message", [
    (["--embed-dim", "64"], r"--init: --embed-dim cannot differ from the pretrained model's"),
    (["--preset", "tiny"], r"expected no --preset, got tiny"),
])
def test_init_refuses_another_architecture_in_one_line(timm_small_grid, split_image_folder, tmp_path, capsys,
                                                       flags, message):
    _, source = timm_small_grid
    assert main(["train", "--init", str(source), "--data", str(split_image_folder), "--out", str(tmp_path / "run"),
                 *flags, *FAST_TRAIN]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and re.search(message, error), error


def test_loading_a_transformers_vit_as_a_vit_hub_model_points_to_import(hf_classifier, capsys):
    _, folder = hf_classifier
    assert main(["predict", "--model", str(folder), str(folder / "config.json")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"convert a ViT with: vit-hub import {folder} --out DIR" in error
