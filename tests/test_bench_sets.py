"""The shifted benchmark's generated sets (bench/shifted_sets.py) and the digit uploads
(bench/digit_uploads.py): deterministic, in the layout vit_hub reads, and really shifted."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bench import digit_uploads, shifted_sets
from vit_hub.data.sources import load_splits

SMALL = 0.02  # 2-4 images per class and split: enough to check layout and determinism


def fingerprint(folder: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under `folder`."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def split_files(folder: Path, split: str) -> list[Path]:
    return sorted(path for path in (folder / split).rglob("*") if path.is_file())


def mean_colour(paths: list[Path]) -> np.ndarray:
    return np.mean([np.asarray(Image.open(path).convert("RGB"), np.float64).mean((0, 1)) for path in paths], 0)


@pytest.mark.parametrize("name", sorted(shifted_sets.GENERATORS))
def test_generators_are_deterministic_for_a_seed(name, tmp_path):
    make = shifted_sets.GENERATORS[name]
    first = fingerprint(make(tmp_path / "a", seed=3, scale=SMALL))
    assert first == fingerprint(make(tmp_path / "b", seed=3, scale=SMALL))
    other = fingerprint(make(tmp_path / "c", seed=4, scale=SMALL))
    assert first.keys() == other.keys() and first != other


@pytest.mark.parametrize("name", sorted(shifted_sets.GENERATORS))
def test_vit_hub_reads_train_and_test_with_balanced_classes(name, tmp_path):
    folder = shifted_sets.GENERATORS[name](tmp_path, seed=0, scale=SMALL)
    assert folder == tmp_path / name
    splits = load_splits(str(folder), val_split=0.1, seed=0)
    classes = sorted(path.name for path in (folder / "train").iterdir())
    assert splits.labels == classes and len(classes) >= 2
    for split in ("train", "test"):
        counts = Counter(path.parent.name for path in split_files(folder, split))
        assert set(counts) == set(classes) and len(set(counts.values())) == 1, counts
    assert len(splits.train) + len(splits.val) == len(split_files(folder, "train"))
    assert len(splits.test) == len(split_files(folder, "test"))


def test_full_counts_and_shapes_tiny_images(tmp_path):
    folder = shifted_sets.make_shapes_tiny(tmp_path)
    for split, per_class in (("train", 60), ("test", 20)):
        assert Counter(path.parent.name for path in split_files(folder, split)) == {"circle": per_class,
                                                                                     "square": per_class}
    image = Image.open(split_files(folder, "test")[0])
    assert image.size == (48, 48) and image.mode == "L"


def test_scale_shrinks_counts_and_keeps_each_image(tmp_path):
    small = fingerprint(shifted_sets.make_cells(tmp_path / "small", scale=0.01))
    larger = fingerprint(shifted_sets.make_cells(tmp_path / "larger", scale=0.02))
    assert len(small) < len(larger)
    assert all(larger[path] == digest for path, digest in small.items())  # image i does not depend on the count


def test_cells_test_split_comes_from_another_stain(tmp_path):
    folder = shifted_sets.make_cells(tmp_path, scale=0.03)
    train, test = mean_colour(split_files(folder, "train")), mean_colour(split_files(folder, "test"))
    assert np.linalg.norm(train - test) > 15, (train, test)
    red_minus_blue = {"train": train[0] - train[2], "test": test[0] - test[2]}
    assert red_minus_blue["train"] - red_minus_blue["test"] > 15  # pink/purple slides vs blue-grey ones
    sizes = [Image.open(path).size for path in split_files(folder, "train")]
    assert all(80 <= side <= 230 for size in sizes for side in size)


def test_objects_are_smaller_and_off_centre_in_test():
    draws = {split: [shifted_sets.object_placement(np.random.default_rng(i), 100, split) for i in range(200)]
             for split in ("train", "test")}
    train_radii = [radius for _, radius in draws["train"]]
    test_radii = [radius for _, radius in draws["test"]]
    assert max(test_radii) < min(train_radii)
    offsets = {split: np.mean([np.abs(centre - 50).max() for centre, _ in placed]) for split, placed in draws.items()}
    assert offsets["test"] > 1.5 * offsets["train"]


def test_lighting_test_split_is_relit_and_jpeg(tmp_path):
    folder = shifted_sets.make_lighting(tmp_path, scale=0.02)
    assert {path.suffix for path in split_files(folder, "train")} == {".png"}
    assert {path.suffix for path in split_files(folder, "test")} == {".jpg"}

    def brightness_offsets(split: str) -> float:
        means = [np.asarray(Image.open(path).convert("L"), np.float64).mean() for path in split_files(folder, split)]
        return float(np.mean(np.abs(np.asarray(means) - 128)))

    assert brightness_offsets("test") > brightness_offsets("train") + 10


@pytest.fixture(scope="module")
def uploads(tmp_path_factory) -> list[Path]:
    return digit_uploads.make_uploads(tmp_path_factory.mktemp("uploads"), seed=0)


def test_digit_uploads_are_generated_as_described(uploads):
    paths = uploads
    groups = {group: [path for path in paths if path.name.startswith(group + "_")] for group in digit_uploads.GROUPS}
    for group, files in groups.items():
        assert len(files) == 30
        assert Counter(digit_uploads.true_label(path) for path in files) == {str(d): 3 for d in range(10)}
    for path in groups["photo"]:
        with Image.open(path) as image:
            assert image.format == "JPEG" and sorted(image.size) == [300, 400]
            gray = np.asarray(image.convert("L"), np.float64)
        assert np.median(gray) > 120 and gray.min() < 90  # dark ink on lit paper
    for path in groups["typed"]:
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size == (200, 200)
            assert np.median(np.asarray(image)) == 255 and np.asarray(image).min() <= 40


def test_digit_uploads_are_deterministic(uploads, tmp_path):
    again = digit_uploads.make_uploads(tmp_path, seed=0)
    assert [path.name for path in again] == [path.name for path in uploads]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(again, uploads))


def test_digit_uploads_score_per_group():
    paths = [Path("photo_00_label_3.jpg"), Path("photo_01_label_4.jpg"), Path("typed_00_label_0.png")]
    ranked = [[("3", 0.9), ("8", 0.05)], [("9", 0.6), ("4", 0.3)], [("0", 0.8)]]
    report = digit_uploads.summarise(paths, ranked)
    assert report["groups"] == {"photo": {"right": 1, "total": 2}, "typed": {"right": 1, "total": 1}}
    assert [record["predicted"] for record in report["images"]] == ["3", "9", "0"]


def test_marked_objects_each_scene_shows_every_colour_and_frames_one(tmp_path):
    """bench/marked_objects.py: deterministic, balanced, 32x32 RGB; the framed object's colour
    is the label, and colourfulness (the model-free "where are the objects" map) lights up
    many patches, not one."""
    from bench import marked_objects

    folder = marked_objects.make_marked(tmp_path / "a", seed=1, scale=0.005)
    assert fingerprint(folder) == fingerprint(marked_objects.make_marked(tmp_path / "b", seed=1, scale=0.005))
    splits = load_splits(str(folder), val_split=0.0)
    assert splits.labels == sorted(marked_objects.COLOURS)
    counts = Counter(path.parent.name for path in split_files(folder, "train"))
    assert set(counts) == set(marked_objects.COLOURS) and len(set(counts.values())) == 1
    for path in split_files(folder, "train"):
        pixels = np.asarray(Image.open(path).convert("RGB"), np.float32)
        assert pixels.shape == (32, 32, 3)
        # the frame: the brightest 9x9 square outline; inside it, an object of the label's colour
        white = pixels.min(axis=2)
        ring = np.ones((9, 9), bool)
        ring[1:-1, 1:-1] = False
        scores = {(row, col): white[row - 4:row + 5, col - 4:col + 5][ring].mean()
                  for row in range(4, 28) for col in range(4, 28)}
        row, col = max(scores, key=scores.get)
        centre = pixels[row - 1:row + 2, col - 1:col + 2].reshape(-1, 3)
        colours = {name: np.abs(centre - rgb).sum(1).min() for name, rgb in marked_objects.COLOURS.items()}
        assert min(colours, key=colours.get) == path.parent.name
        objects = marked_objects.object_map(pixels.transpose(2, 0, 1)[None], (4, 4))[0]  # [8, 8]
        assert (objects > 40).sum() >= 8  # eight objects light up, not only the framed one
