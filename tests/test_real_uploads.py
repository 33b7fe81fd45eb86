"""bench/real_uploads.py's own logic, on generated images in the dev folder's layout (the real
dev images live outside the project and no test reads them)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from bench import digit_uploads, real_uploads
from bench.real_uploads import Answer
from vit_hub.data.sources import load_splits
from vit_hub.model.config import ViTConfig

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "vit-mnist"


def typed(digit: int, seed: int = 0) -> Image.Image:
    return digit_uploads.typed_digit(digit, digit_uploads.FONTS[0], np.random.default_rng(seed))


@pytest.fixture
def dev(tmp_path: Path) -> Path:
    """Two typed digits by two writers and a blank canvas, in the dev layout, with a manifest."""
    for relative, image in {"photo/3/alice+digits__3.png": typed(3),
                            "painted/7/bob+paint-app__seven.jpg": typed(7),
                            "painted/5/bob+paint-app__blank.png": Image.new("RGB", (300, 300), "white")}.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        image.save(tmp_path / relative)
    (tmp_path / "MANIFEST.csv").write_text("group,label,repo,commit,path,width,height,mode,notes\n")
    return tmp_path


def test_dev_images_read_group_label_and_writer(dev):
    images = real_uploads.dev_images(dev)
    assert [(image.name, image.writer) for image in images] == [
        ("painted/5/bob+paint-app__blank.png", "bob/paint-app"),
        ("painted/7/bob+paint-app__seven.jpg", "bob/paint-app"),
        ("photo/3/alice+digits__3.png", "alice/digits"),
    ]


@pytest.mark.parametrize("relative", ["scan/3/alice+digits__3.png", "photo/three/alice+digits__3.png",
                                      "photo/3/no_writer.png", "photo/alice+digits__3.png"])
def test_dev_images_outside_the_layout_are_refused_in_one_line(dev, relative):
    (dev / relative).parent.mkdir(parents=True, exist_ok=True)
    typed(3).save(dev / relative)
    with pytest.raises(ValueError, match=f"^--dev: expected images in .*, found {re.escape(relative)}$"):
        real_uploads.dev_images(dev)


def test_a_missing_or_empty_dev_folder_is_refused(tmp_path):
    with pytest.raises(NotADirectoryError, match="found nothing at"):
        real_uploads.dev_images(tmp_path / "absent")
    with pytest.raises(ValueError, match="found none in"):
        real_uploads.dev_images(tmp_path)


def record(writer: str, group: str, label: str, **answers: Answer) -> dict:
    return {"file": f"{group}/{label}/x.png", "group": group, "label": label, "writer": writer,
            **{route: vars(answer) for route, answer in answers.items()}}


def test_tables_count_refusals_as_wrong_and_apart():
    right, wrong, refused = Answer("3", 0.9), Answer("5", 0.6), Answer(refused="blank image (no ink)")
    rows = [record("a/b", "photo", "3", torch=right, cnn=wrong),
            record("a/b", "photo", "3", torch=refused, cnn=right),
            record("c/d", "painted", "3", torch=right, cnn=refused)]
    writers, groups = real_uploads.tallies(rows)
    assert [(row["writer"], row["group"], row["n"]) for row in writers] == [("a/b", "photo", 2), ("c/d", "painted", 1)]
    assert groups["photo"] == {"n": 2, "torch": {"right": 1, "refused": 1}, "cnn": {"right": 1, "refused": 0}}
    table = real_uploads.markdown_table(writers, groups).splitlines()
    assert table[0] == "| writer | group | n | ViT /predict torch | CNN | refused (torch / cnn) |"
    assert table[2] == "| a/b | photo | 2 | 1/2 | 1/2 | 1 / 0 |"
    assert table[4] == "| **all photo** | photo | 2 | **1/2** (0.500) | **1/2** (0.500) | 1 / 0 |"
    assert real_uploads.differences(rows, "torch", "cnn") == [
        "  photo/3/x.png (label 3): ViT /predict torch refused (blank image (no ink)), CNN 3 (0.90)"]


def test_the_reference_cache_follows_the_pixels_it_learns_from():
    """The cache file's name changes with what the canonical pixels depend on (here the mean),
    not with the ViT's architecture, and with the recipe and the reference."""
    config = ViTConfig.from_json(MODEL_DIR / "config.json")
    train = load_splits("mnist", val_split=0.0).train
    deeper = ViTConfig.from_dict({**config.to_dict(), "depth": config.depth + 1})
    renormalised = ViTConfig.from_dict({**config.to_dict(), "mean": [0.5]})
    fingerprint = real_uploads.pixels_fingerprint(train, config)
    assert real_uploads.pixels_fingerprint(train, deeper) == fingerprint
    assert real_uploads.pixels_fingerprint(train, renormalised) != fingerprint
    name = real_uploads.cache_file(Path("/cache"), "cnn", config, fingerprint, epochs=2, seed=0)
    assert real_uploads.cache_file(Path("/cache"), "cnn", config, fingerprint, epochs=3, seed=0) != name
    assert real_uploads.cache_file(Path("/cache"), "resnet18", config, fingerprint, epochs=2, seed=0) != name
    assert sum(weight.numel() for weight in real_uploads.small_cnn(config).parameters()) == 50_698
    resnet = real_uploads.resnet18(config)
    assert resnet(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert sum(weight.numel() for weight in resnet.parameters()) == 11_175_370


@pytest.mark.slow
def test_every_route_scores_uploads_and_counts_a_blank_as_refused(dev):
    """The live app (torch /predict, /explain_drawing, ONNX /predict) and the references' preprocessing:
    typed digits are read, the blank canvas is refused by each route, not skipped."""
    images = real_uploads.dev_images(dev)
    config = ViTConfig.from_json(MODEL_DIR / "config.json")
    threads = torch.get_num_threads()
    try:
        answers = {**real_uploads.score_through_app(images, str(MODEL_DIR)),
                   **{name: real_uploads.score_with_reference(images, net(config).eval(), config)
                      for name, net in real_uploads.REFERENCES.items()}}
    finally:
        torch.set_num_threads(threads)  # the torch app sets one thread for the process
    rows = real_uploads.records(images, answers)
    for route in ("torch", "onnx", "sketch"):
        assert [row[route]["predicted"] for row in rows] == [None, "7", "3"], route
    for route in real_uploads.ROUTES:
        assert rows[0][route]["refused"], route
    _, groups = real_uploads.tallies(rows)
    assert groups["painted"]["sketch"] == {"right": 1, "refused": 1}
