"""examples/node/classify.mjs: a Node.js app (onnxruntime-node and sharp, no Python) running a model
dir's pipeline.onnx gives the Python app's labels, on the sample digits, on generated uploads
people make, and for an RGB photo model; with --map it gives the Python app's map and writes its
overlay: the map the Python page opens with (pipeline_explain.onnx's gradients), or rollout with
--rollout, or pipeline_map.onnx's rollout for a model dir exported before pipeline_explain.onnx.
`make install-dev` installs its pinned packages."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from conftest import assert_one_line, assert_same_overlay, digit_on_paper, python_app_map, python_page_map, train_tiny
from vit_hub.demo.backends import TorchPredictor
from vit_hub.export import OnnxClassifier, export_onnx
from vit_hub.processing.preprocess import UPLOAD_MAX_PIXELS, load_image, open_image

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "node"
MODEL_DIR = ROOT / "models" / "vit-mnist"
SAMPLES = sorted((ROOT / "vit_hub" / "bundled" / "samples").glob("mnist_test_*_label_*.png"))


def classify_in_node(model_dir: Path, images: list[Path], *flags: str) -> list[dict]:
    """One JSON row per image from the Node example."""
    assert (EXAMPLE / "node_modules" / "onnxruntime-node").is_dir(), "run `make install-dev` (npm ci in examples/node)"
    done = subprocess.run(["node", "classify.mjs", str(model_dir), *map(str, images), *flags], cwd=EXAMPLE,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [row["file"] for row in rows] == list(map(str, images))
    return rows


def python_app_answers(model_dir: Path, images: list[Path]) -> list[list[tuple[str, float]]]:
    """What the app answers for each upload: read as it reads one, then the ONNX backend's ranking."""
    classifier = OnnxClassifier(model_dir, providers="cpu")
    return [classifier.predict(load_image(open_image(path, path.name, UPLOAD_MAX_PIXELS)), top_k=2) for path in images]


def uploads_people_make(folder: Path) -> list[Path]:
    """Of sample digits: a phone photo on paper (JPEG), a pen stroke on a screenshot-sized
    transparent canvas, a scan in gray with alpha; and a bold marker 7."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for sample in SAMPLES[:5]:
        photo = folder / f"{sample.stem}_photo.jpg"
        digit_on_paper(sample).save(photo, quality=90)
        ink = Image.open(sample).convert("L").resize((280, 280), Image.Resampling.BICUBIC).point(lambda v: 255 * (v > 90))
        canvas = Image.new("RGBA", (1280, 720), (255, 255, 255, 0))
        canvas.paste(Image.new("RGBA", (280, 280), (25, 25, 110, 255)), (610, 300), ink)
        screenshot = folder / f"{sample.stem}_canvas.png"
        canvas.save(screenshot)
        gray_alpha = Image.open(sample).convert("L").resize((112, 112)).convert("LA")
        gray_alpha.putalpha(200)
        scan = folder / f"{sample.stem}_gray_alpha.png"
        gray_alpha.save(scan)
        paths += [photo, screenshot, scan]
    marker = Image.new("RGB", (300, 300), "white")
    ImageDraw.Draw(marker).line([(90, 60), (210, 60), (130, 250)], fill="black", width=28)  # a bold 7
    paths.append(folder / "marker_7.png")
    marker.save(paths[-1])
    return paths


def test_node_gives_the_python_apps_labels_on_samples_and_uploads(tmp_path):
    images = [*SAMPLES, *uploads_people_make(tmp_path / "uploads")]
    rows = classify_in_node(MODEL_DIR, images)
    expected = python_app_answers(MODEL_DIR, images)
    assert [row.get("label") for row in rows] == [ranking[0][0] for ranking in expected]
    for row, ranking in zip(rows, expected):
        assert abs(row["top"][0][1] - ranking[0][1]) < 1e-3  # the same probabilities, decoders aside
    assert [row["label"] for row in rows[:len(SAMPLES)]] == [path.stem.rsplit("_", 1)[1] for path in SAMPLES]


@pytest.mark.parametrize("kind", ["sample", "canvas", "gray_alpha"])
def test_node_writes_the_python_pages_opening_map_and_overlay_on_request(kind, tmp_path):
    """--map: the map equals the one the Python page opens with (integrated gradients + gradient
    rollout for the bundled model) within 1e-3, the line names that method and the graph's time,
    and the PNG is the page's overlay."""
    image = SAMPLES[1] if kind == "sample" else next(path for path in uploads_people_make(tmp_path / "uploads")
                                                     if path.stem.endswith(kind))
    (row,) = classify_in_node(MODEL_DIR, [image], "--map", str(tmp_path / "overlay.png"))
    expected_map, expected_overlay, method = python_page_map(TorchPredictor.load(MODEL_DIR), image)
    np.testing.assert_allclose(np.array(row["map"]), expected_map, atol=1e-3)
    assert_same_overlay(np.asarray(Image.open(row["overlay"]).convert("RGB")), expected_overlay)
    assert row["map_method"] == method == "integrated_gradients_rollout" and row["map_ms"] > 0
    assert row["map_label"] == "Integrated gradients + gradient rollout"


@pytest.mark.parametrize("graphs", [("pipeline_explain.onnx", "pipeline_map.onnx"), ("pipeline_explain.onnx",),
                                    ("pipeline_map.onnx",)])
def test_node_draws_the_python_apps_rollout_with_rollout_or_from_an_older_export(graphs, tmp_path):
    """--rollout (the quick map: pipeline_map.onnx's, or pipeline_explain.onnx's rollout output when
    it is alone), and --map on a model dir exported before pipeline_explain.onnx existed: the
    Python app's rollout and overlay, named as rollout."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", *graphs):
        (model / name).write_bytes((MODEL_DIR / name).read_bytes())
    flags = ("--rollout",) if "pipeline_explain.onnx" in graphs else ()
    (row,) = classify_in_node(model, [SAMPLES[1]], "--map", str(tmp_path / "overlay.png"), *flags)
    expected_map, expected_overlay = python_app_map(TorchPredictor.load(MODEL_DIR), SAMPLES[1])
    np.testing.assert_allclose(np.array(row["map"]), expected_map, atol=1e-3)
    assert_same_overlay(np.asarray(Image.open(row["overlay"]).convert("RGB")), expected_overlay)
    assert row["map_method"] == "rollout" and row["map_label"] == "Attention rollout"


def test_node_names_the_export_flag_when_the_map_graph_is_missing(tmp_path):
    for name in ("config.json", "pipeline.onnx"):
        (tmp_path / name).write_bytes((MODEL_DIR / name).read_bytes())
    done = subprocess.run(["node", "classify.mjs", str(tmp_path), str(SAMPLES[0]), "--map", str(tmp_path / "out.png")],
                          cwd=EXAMPLE, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith("expected pipeline_explain.onnx or pipeline_map.onnx in ")
    assert "--output-attentions" in done.stderr and len(done.stderr.splitlines()) == 1


def test_node_asks_for_one_image_with_map(tmp_path):
    done = subprocess.run(["node", "classify.mjs", str(MODEL_DIR), *map(str, SAMPLES[:2]), "--map", "out.png"],
                          cwd=EXAMPLE, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--map OUT.png" in done.stderr and not (EXAMPLE / "out.png").exists()
    done = run_node(MODEL_DIR, str(SAMPLES[0]), "--rollout")  # a map to choose needs --map
    assert done.returncode == 2 and "--map OUT.png [--rollout]" in done.stderr and done.stdout == ""


def test_node_reports_a_refused_or_unreadable_image_and_goes_on(tmp_path):
    blank, broken = tmp_path / "blank.png", tmp_path / "broken.png"
    Image.new("L", (300, 200), 230).save(blank)
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    rows = classify_in_node(MODEL_DIR, [blank, broken, SAMPLES[0]])
    assert "found a blank image (no ink)" in rows[0]["error"]
    assert rows[1]["error"] and "label" not in rows[1]
    assert rows[2]["label"] == "7"


@pytest.mark.slow
def test_node_gives_an_rgb_photo_models_labels(split_image_folder, tmp_path):
    """A model trained on the generated RGB photo folder, exported: Node's labels on its test
    photos, enlarged as a camera would give them, equal the Python app's where the app's top
    two are not tied; its --map overlay of a photo is the Python app's."""
    model_dir = train_tiny(split_image_folder, tmp_path / "model")
    export_onnx(model_dir, model_dir, calib_data=str(split_image_folder), output_attentions=True)
    photos = []
    for index, path in enumerate(sorted((split_image_folder / "test").rglob("*.png"))[:12]):
        enlarged = tmp_path / f"photo_{index}.jpg"
        Image.open(path).convert("RGB").resize((640, 480), Image.Resampling.BICUBIC).save(enlarged, quality=92)
        photos.append(enlarged)
    rows = classify_in_node(model_dir, photos)
    expected = python_app_answers(model_dir, photos)
    decided = [(row["label"], ranking[0][0]) for row, ranking in zip(rows, expected) if ranking[0][1] - ranking[1][1] > 1e-3]
    assert len(decided) >= 8 and all(node == python for node, python in decided)
    photo = tmp_path / "photo.png"  # the map over the upload itself, in colour
    Image.open(photos[0]).save(photo)
    (row,) = classify_in_node(model_dir, [photo], "--map", str(tmp_path / "overlay.png"))
    expected_map, expected_overlay, method = python_page_map(TorchPredictor.load(model_dir), photo)
    assert row["map_method"] == method
    np.testing.assert_allclose(np.array(row["map"]), expected_map, atol=1e-3)
    assert_same_overlay(np.asarray(Image.open(row["overlay"]).convert("RGB")), expected_overlay)


def test_another_models_graph_is_refused_in_one_line(tmp_path):
    """pipeline.onnx of a 10-class model beside the config.json of a 12-class one: the labels'
    count is checked against the graph's output before any image runs."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "pipeline.onnx").write_bytes((MODEL_DIR / "pipeline.onnx").read_bytes())
    config = json.loads((MODEL_DIR / "config.json").read_text())
    config.update(labels=[f"class {index}" for index in range(12)], num_classes=12)
    (model_dir / "config.json").write_text(json.dumps(config))
    done = subprocess.run(["node", "classify.mjs", str(model_dir), str(SAMPLES[0])], cwd=EXAMPLE,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert_one_line(done.stderr, "expected pipeline.onnx to give one probability per label of config.json (12 labels), "
                                 "found probabilities of shape [10]")


# --map OUT and config.json from an untrusted hand -------------------------------------------
def run_node(model_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["node", "classify.mjs", str(model_dir), *args], cwd=EXAMPLE, capture_output=True,
                          text=True, timeout=300)


def files_in(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


@pytest.mark.parametrize("case", ["the input", "the input by another name", "an existing file", "a link to a file",
                                  "a dangling link", "a folder"])
def test_map_never_writes_over_a_file_or_through_a_link(case, tmp_path):
    """`--map OUT` writes only a new file: the input image, any file that exists, a link (even
    one pointing nowhere: it would create its target) and a folder are refused in one line
    before anything runs, and no file changes."""
    image = tmp_path / "digit.png"
    image.write_bytes(SAMPLES[0].read_bytes())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("a person's notes\n")
    out = {"the input": image, "the input by another name": tmp_path / "." / "digit.png",
           "an existing file": elsewhere / "notes.txt", "a link to a file": tmp_path / "link.png",
           "a dangling link": tmp_path / "dangling.png", "a folder": elsewhere}[case]
    if case == "a link to a file":
        out.symlink_to(elsewhere / "notes.txt")
    if case == "a dangling link":
        out.symlink_to(elsewhere / "created.png")
    before = (files_in(tmp_path), files_in(elsewhere))
    done = run_node(MODEL_DIR, str(image), "--map", str(out))
    assert done.returncode == 2 and done.stdout == ""
    assert_one_line(done.stderr, "--map: expected a new file to write the overlay to, found", str(out))
    assert (files_in(tmp_path), files_in(elsewhere)) == before
    assert "input image" in done.stderr if case.startswith("the input") else "input image" not in done.stderr


@pytest.mark.parametrize("out", ["missing/overlay.png", "/dev/full", "/sys/overlay.png"])
def test_map_that_cannot_be_written_fails_in_one_line(out, tmp_path):
    """A folder that does not exist and a device are refused before anything runs (exit 2); a
    write that fails (root may not create files in /sys either) exits 1, leaving nothing behind."""
    out = str(tmp_path / out) if out.startswith("missing") else out
    done = run_node(MODEL_DIR, str(SAMPLES[0]), "--map", out)
    assert done.returncode == (1 if out.startswith("/sys") else 2) and done.stdout == ""
    assert_one_line(done.stderr, "--map: expected", out)
    assert not list(Path(out).parent.glob(".classify-*")) if not out.startswith("/dev") else True


def test_map_writes_through_a_temporary_file_beside_it(tmp_path):
    """The overlay is written beside OUT and renamed to it: after a run only OUT is there."""
    (row,) = classify_in_node(MODEL_DIR, [SAMPLES[0]], "--map", str(tmp_path / "overlay.png"))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["overlay.png"]
    assert Image.open(row["overlay"]).size[0] > 0


@pytest.mark.parametrize("config", ["{\"labels\": [", "", "null", "{\"labels\": \"0123456789\"}"])
def test_a_config_that_is_not_json_or_has_no_labels_is_refused_in_one_line(config, tmp_path):
    (tmp_path / "pipeline.onnx").write_bytes((MODEL_DIR / "pipeline.onnx").read_bytes())
    (tmp_path / "config.json").write_text(config)
    done = run_node(tmp_path, str(SAMPLES[0]))
    assert done.returncode == 2 and done.stdout == ""
    assert_one_line(done.stderr, "config.json")


def test_a_missing_config_is_refused_in_one_line(tmp_path):
    (tmp_path / "pipeline.onnx").write_bytes((MODEL_DIR / "pipeline.onnx").read_bytes())
    done = run_node(tmp_path, str(SAMPLES[0]))
    assert done.returncode == 2
    assert_one_line(done.stderr, f"expected config.json in {tmp_path}, found none")
