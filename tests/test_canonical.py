"""Input canonicalisation (vit_hub/processing/canonical.py) and that every path applies it alike."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFilter, ImageOps
from scipy import ndimage

from conftest import digit_on_paper
from vit_hub.data.augmentation import TrainTransform
from vit_hub.data.batches import EvalTransform
from vit_hub.model.config import ViTConfig
from vit_hub.processing import canonical as canonical_module
from vit_hub.processing.canonical import NEARLY_BLANK, STROKE_SHARE, EmptyImageError, centre_digit, stroke_width
from vit_hub.processing.preprocess import preprocess, to_model_domain, to_model_mode

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "vit-mnist"
SAMPLES = sorted((ROOT / "vit_hub" / "bundled" / "samples").glob("mnist_test_*_label_*.png"))


def label_of(path: Path) -> str:
    return re.search(r"_label_(\d+)\.png$", path.name).group(1)


def digit(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("L"), dtype=np.float64)


def correlation(first, second) -> float:
    return float(np.corrcoef(np.asarray(first, dtype=np.float64).ravel(),
                             np.asarray(second, dtype=np.float64).ravel())[0, 1])


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda path: path.name)
def test_an_mnist_digit_is_left_almost_as_it_is(sample):
    """Its stroke is set to MNIST's median width, so a thin or bold one changes a little."""
    assert correlation(centre_digit(Image.open(sample), (28, 28)), digit(sample)) > 0.85


@pytest.mark.parametrize("sample", SAMPLES[:4], ids=lambda path: path.name)
def test_ink_polarity_is_read_from_the_image(sample):
    light_on_dark = centre_digit(Image.open(sample), (28, 28))
    dark_on_light = centre_digit(ImageOps.invert(Image.open(sample).convert("L")), (28, 28))
    assert correlation(light_on_dark, dark_on_light) > 0.99


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda path: path.name)
def test_a_photo_with_uneven_light_becomes_the_digit(sample):
    result = centre_digit(to_model_mode(digit_on_paper(sample), 1), (28, 28))
    assert result.mode == "L" and result.size == (28, 28)
    assert correlation(result, digit(sample)) > 0.85


def test_a_speck_of_dust_does_not_move_the_crop():
    clean = centre_digit(to_model_mode(digit_on_paper(SAMPLES[0], light=False), 1), (28, 28))
    dusty = centre_digit(to_model_mode(digit_on_paper(SAMPLES[0], light=False, speck=True), 1), (28, 28))
    assert correlation(clean, dusty) > 0.97


def test_the_digit_fills_the_configured_box_and_is_centred_by_mass():
    canvas = Image.new("L", (300, 300), 0)
    canvas.paste(255, (20, 40, 60, 200))  # a light bar on black, top left
    result = np.asarray(centre_digit(canvas, (32, 48)))  # height 32, width 48
    assert result.shape == (32, 48)
    rows, cols = np.nonzero(result > 128)
    assert rows.max() - rows.min() + 1 == round(32 * 20 / 28)  # the tall side fills the 20/28 box
    assert abs(rows.mean() - 16) < 1.5 and abs(cols.mean() - 24) < 1.5


def test_a_drawing_in_two_grey_levels_is_a_digit():
    """Every mark has the same contrast (no anti-aliasing, no noise): one class of ink."""
    page = Image.new("L", (40, 36), 235)
    ImageDraw.Draw(page).line((8, 6, 24, 30), fill=20, width=3)
    result = np.asarray(centre_digit(page, (28, 28)))
    rows, cols = np.nonzero(result > 128)
    assert rows.max() - rows.min() + 1 == 20 and abs(rows.mean() - 14) < 1.5 and abs(cols.mean() - 14) < 1.5


@pytest.mark.parametrize("image", [Image.new("RGB", (400, 400), "white"), Image.new("L", (50, 50), 0),
                                   Image.new("L", (64, 64), 128)])
def test_a_blank_image_is_refused(image):
    with pytest.raises(EmptyImageError, match="expected an image of a digit, found"):
        centre_digit(to_model_mode(image, 1), (28, 28))


# Pen, paper and canvas as people upload them ----------------------------------------------------
# Digits as pen paths in a unit box (x right, y down): what a person draws, at any size and width.
PATHS = {
    "7": [[(0.15, 0.05), (0.85, 0.05), (0.4, 0.95)]],
    "4": [[(0.65, 0.95), (0.65, 0.05), (0.1, 0.65), (0.9, 0.65)]],
    "2": [[(0.15, 0.25), (0.35, 0.05), (0.7, 0.05), (0.85, 0.25), (0.8, 0.45), (0.15, 0.95), (0.9, 0.95)]],
}
CLOSED_FOUR = [[(0.7, 0.95), (0.7, 0.05), (0.4, 0.35), (0.95, 0.35)]]  # its triangle a sixth of its height


def drawn(label: str, canvas=(300, 300), box=(50, 50, 250, 250), width=12, ink=255, paper=0,
          mode="L") -> Image.Image:
    """`label`'s pen path drawn `width` px wide into `box` (left, top, right, bottom) of a canvas."""
    image = Image.new(mode, canvas, paper)
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = box
    for path in PATHS[label] if label in PATHS else CLOSED_FOUR:
        points = [(left + x * (right - left), top + y * (bottom - top)) for x, y in path]
        draw.line(points, fill=ink, width=width, joint="curve")
    return image


def canonical(image: Image.Image) -> Image.Image:
    return centre_digit(to_model_mode(image, 1), (28, 28))


def likeness(first: Image.Image, second: Image.Image) -> float:
    """Correlation of two 28x28 digits seen slightly out of focus, so a pixel's shift of a
    3 px stroke counts little: the same path drawn differently scores above 0.9, another
    digit's path below 0.65."""
    blur = ImageFilter.GaussianBlur(1.5)
    return correlation(first.filter(blur), second.filter(blur))


def photographed(image: Image.Image, seed: int = 0) -> Image.Image:
    """An RGB drawing on tinted paper as a phone sees it: light falling off across the page
    and sensor noise."""
    pixels = np.asarray(image, dtype=np.float64)
    rows, cols = np.mgrid[0:image.height, 0:image.width]
    light = 1.0 - 0.25 * cols / image.width - 0.15 * rows / image.height
    noise = np.random.default_rng(seed).normal(0, 3, pixels.shape)
    return Image.fromarray(np.clip(pixels * light[..., None] + noise, 0, 255).astype(np.uint8))


@pytest.mark.parametrize("label", PATHS)
def test_a_hairline_on_a_large_canvas_is_a_digit_drawn_with_mnist_strokes(label):
    """1 px drawn in a paint program on a 1150x650 canvas (the digit a tenth of it): found,
    thickened to the width a marker drawing of the same path gets."""
    hairline = canonical(drawn(label, (1150, 650), (500, 250, 600, 370), width=1, ink=(0, 0, 0, 255),
                                paper=(255, 255, 255, 255), mode="RGBA"))
    assert likeness(hairline, canonical(drawn(label, width=24))) > 0.85


@pytest.mark.parametrize("label", PATHS)
def test_a_thin_ballpoint_on_tinted_paper_is_a_digit(label):
    pen = drawn(label, (1000, 750), (400, 250, 560, 450), width=2, ink=(40, 45, 160), paper=(205, 195, 170),
                mode="RGB")
    assert likeness(canonical(photographed(pen)), canonical(drawn(label, width=24))) > 0.85


@pytest.mark.parametrize("label", PATHS)
def test_thin_white_strokes_on_black_are_a_digit(label):
    thin = canonical(drawn(label, (150, 150), (30, 20, 120, 130), width=1))
    assert likeness(thin, canonical(drawn(label, width=24))) > 0.85


@pytest.mark.parametrize("width", [1, 3, 12, 40])
def test_every_pen_width_ends_at_mnist_s_stroke_width(width):
    shape = np.asarray(canonical(drawn("4", (600, 600), (100, 100, 500, 500), width=width))) > 127
    assert stroke_width(shape) == pytest.approx(STROKE_SHARE * 20, rel=0.35)  # the digit is 20 px tall


def test_marks_showing_through_the_page_and_squared_paper_are_not_ink():
    clean = drawn("7", (400, 400), (100, 80, 300, 320), width=8, ink=40, paper=220)
    page = np.asarray(clean, dtype=np.float64)
    back = np.asarray(ImageOps.mirror(drawn("2", (400, 400), (60, 60, 340, 340), width=8)), dtype=np.float64)
    page -= 0.2 * (220 - 40) / 255 * back  # the other side's digit, a fifth as dark as the ink
    page[::25, :] -= 27  # the lines of squared paper, 15 % as dark (where they cross the other
    page[:, ::25] -= 27  # side's digit the two add up to 35 %: still under INK_LEVEL)
    marked = Image.fromarray(np.clip(page, 0, 255).astype(np.uint8))
    assert likeness(canonical(marked), canonical(clean)) > 0.9


def test_a_ruled_line_across_the_photo_is_not_part_of_the_digit():
    clean = drawn("7", (240, 200), (70, 30, 170, 150), width=6, ink=30, paper=200)
    ruled = clean.copy()
    ImageDraw.Draw(ruled).line([(0, 165), (239, 162)], fill=60, width=3)  # from edge to edge, under the digit
    assert likeness(canonical(ruled), canonical(clean)) > 0.95


PAPER_ON_A_DESK = (215, 210, 200)


@pytest.mark.parametrize("framing", ["desk beside the paper", "shadow band along the bottom", "desk on two sides",
                                     "desk in a corner"])
def test_the_desk_or_a_shadow_beyond_the_paper_is_not_part_of_the_digit(framing):
    """A phone photo whose frame shows more than the page: a dark band running along a whole
    side (the desk, the shadow of the phone), or a corner of desk where the page is turned,
    is background, however thick."""
    clean = drawn("7", (800, 600), (300, 150, 480, 450), width=10, ink=(30, 30, 40), paper=PAPER_ON_A_DESK, mode="RGB")
    framed = clean.copy()
    draw = ImageDraw.Draw(framed)
    if framing in ("desk beside the paper", "desk on two sides"):
        draw.rectangle((0, 0, 150, 600), fill=(90, 60, 40))  # a fifth of the width
    if framing in ("shadow band along the bottom", "desk on two sides"):
        draw.rectangle((0, 500, 800, 600), fill=(110, 105, 100))  # a sixth of the height
    if framing == "desk in a corner":
        draw.polygon([(0, 0), (250, 0), (0, 300)], fill=(90, 60, 40))
    assert likeness(canonical(photographed(framed)), canonical(clean)) > 0.95


def test_a_tight_crop_touching_an_edge_keeps_its_digit():
    """A digit cropped so tight that its base lies along most of the bottom edge, beside a
    small mark (a cursor left in a drawing), is still the digit: it does not reach from edge
    to edge, as the desk does."""
    drawing = drawn("2", (168, 168), (6, 8, 162, 170), width=14, ink=90, paper=255)
    ImageDraw.Draw(drawing).ellipse((150, 110, 162, 122), outline=200)
    assert likeness(canonical(drawing), canonical(drawn("2", width=14))) > 0.9


def test_a_tight_crop_of_a_digit_drawn_in_two_strokes_keeps_both():
    """A 7 whose bar runs along the top edge and whose separate stem runs down the right edge:
    neither stroke fills a corner as the desk does, so both stay."""
    seven = Image.new("L", (120, 160), 255)
    draw = ImageDraw.Draw(seven)
    draw.line([(0, 5), (119, 5)], fill=0, width=11)  # the bar, edge to edge but thick, along the top
    draw.line([(113, 14), (113, 159)], fill=0, width=12)  # the stem, along the right edge
    shape = np.asarray(canonical(seven)) > 127
    rows = np.nonzero(shape.any(axis=1))[0]
    assert shape[rows[0]].sum() >= 10  # the bar across the top
    assert np.ptp(rows) >= 15 and shape[rows[0] + 4:].sum(axis=1).max() <= 4  # the stem under it, alone


def test_thickening_a_hairline_keeps_a_closed_four_open():
    """The 4's small triangle stays a hole at MNIST's stroke width (filled, it reads as a 9)."""
    four = np.asarray(canonical(drawn("closed 4", (600, 600), (200, 150, 400, 450), width=1))) > 127
    assert (ndimage.binary_fill_holes(four) & ~four).sum() >= 4


def test_specks_beside_the_digit_are_dropped():
    clean = drawn("7", (300, 300), (60, 40, 240, 260), width=10)
    speckled = clean.copy()
    ImageDraw.Draw(speckled).ellipse((200, 240, 206, 246), fill=255)  # a dot near the stroke's foot
    assert np.array_equal(np.asarray(canonical(speckled)), np.asarray(canonical(clean)))


@pytest.mark.parametrize("image", [photographed(Image.new("RGB", (800, 600), (205, 195, 170))),
                                   Image.new("RGBA", (1150, 650), (0, 0, 0, 0))])
def test_a_blank_page_or_canvas_is_still_refused(image):
    with pytest.raises(EmptyImageError, match="expected an image of a digit, found"):
        canonical(image)


def speck_on_white(side: int, speck: int) -> Image.Image:
    """A white square picture with a dark square speck of `speck` pixels a side in its middle."""
    pixels = np.full((side, side), 255, np.uint8)
    pixels[side // 2:side // 2 + speck, side // 2:side // 2 + speck] = 0
    return Image.fromarray(pixels)


@pytest.mark.parametrize("side, speck", [(28, 1), (64, 3), (300, 1), (300, 5), (400, 8)])
def test_a_lone_dark_pixel_or_a_speck_on_white_is_no_digit(side, speck):
    """A speck whose longer side spans under 4 pixels, or under 2.5 % of the picture's, is
    refused as a nearly blank image (a lone pixel on 300x300 white was a "0" at 0.975)."""
    with pytest.raises(EmptyImageError, match=re.escape(NEARLY_BLANK)):
        canonical(speck_on_white(side, speck))


def test_a_small_digit_on_a_large_page_is_still_a_digit():
    """A handwritten digit 4 % as tall as the page it is written on (a whole sheet photographed)
    is well above the speck's limits, and canonicalises as it does alone."""
    sample = Image.open(SAMPLES[0]).convert("L")
    page = Image.new("L", (2000, 1500), 255)
    page.paste(ImageOps.invert(sample).resize((112, 112), Image.Resampling.BICUBIC), (900, 700))
    alone = ImageOps.invert(sample).resize((112, 112), Image.Resampling.BICUBIC)
    assert correlation(canonical(page), canonical(alone)) > 0.9


@pytest.mark.parametrize("invert", [False, True], ids=["light ink on dark", "dark ink on paper"])
def test_the_whole_picture_is_shrunk_once_each_way_and_gives_the_same_digit(monkeypatch, invert):
    """The full-size picture is shrunk to the search plane twice (inverted and as it is, to
    read the ink's polarity), and the paper and the ink box are found on the copy already made:
    a shrink per step was twice the work for the same digit."""
    sample = Image.open(SAMPLES[0]).convert("L").resize((900, 700), Image.Resampling.BICUBIC)
    picture = ImageOps.invert(sample) if invert else sample
    expected = np.asarray(centre_digit(picture, (28, 28)))
    calls = []
    real_shrink = canonical_module.shrink
    monkeypatch.setattr(canonical_module, "shrink",
                        lambda signal, longest: calls.append(signal.size) or real_shrink(signal, longest))
    np.testing.assert_array_equal(np.asarray(centre_digit(picture, (28, 28))), expected)
    assert calls.count((900, 700)) == 2


def test_the_config_names_the_canonicalisation():
    assert ViTConfig().canonicalize == "none"
    assert ViTConfig.from_preset("mnist").canonicalize == "digit"
    with pytest.raises(ValueError, match="canonicalize: expected one of none, digit, got 'face'"):
        ViTConfig(canonicalize="face")
    image = Image.new("RGB", (30, 20), (10, 200, 30))
    assert to_model_domain(image, ViTConfig()) is image  # "none": as it is, already RGB
    with pytest.raises(ValueError, match="expected a grayscale \\(L\\) image, got mode RGB"):
        centre_digit(image, (28, 28))


# Every path applies it ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """One photo of each bundled sample digit, as an image folder `<label>/<file>.jpg`."""
    root = tmp_path_factory.mktemp("photos")
    for sample in SAMPLES:
        (root / label_of(sample)).mkdir()
        digit_on_paper(sample).save(root / label_of(sample) / f"{sample.stem}.jpg", quality=80)
    return root


def photo_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.jpg"))


def test_torch_onnx_and_training_transforms_see_the_same_pixels(photos):
    from vit_hub.export import OnnxClassifier
    from vit_hub.hub.pretrained import load_model, predict_images

    model = load_model(MODEL_DIR)
    classifier = OnnxClassifier(MODEL_DIR / "model.onnx")
    files = photo_files(photos)
    expected = np.stack([preprocess(path, model.config) for path in files])
    np.testing.assert_array_equal(classifier.preprocess(files), expected)
    evaluated = EvalTransform(model.config)
    unaugmented = TrainTransform(model.config, "none")
    with Image.open(files[0]) as image:
        np.testing.assert_array_equal(evaluated(image).numpy(), expected[0])
        np.testing.assert_array_equal(unaugmented(image).numpy(), expected[0])
    torch_top = [ranked[0][0] for ranked in predict_images(model, files, top_k=1)]
    onnx_top = [ranked[0][0] for ranked in classifier.predict(files, top_k=1)]
    assert torch_top == onnx_top == [path.parent.name for path in files]


def test_eval_on_a_folder_of_photos_canonicalises_them(photos, capsys):
    from vit_hub.cli import main

    assert main(["eval", "--model", str(MODEL_DIR), "--data", str(photos), "--split", "train",
                 "--val-split", "0"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["n"] == len(SAMPLES) and result["accuracy"] == 1.0


def test_without_canonicalisation_the_same_photos_fail(photos):
    """The control: the bundled model on raw photos, canonicalisation off, is near chance."""
    from vit_hub.hub.pretrained import load_model

    model = load_model(MODEL_DIR)
    model.config.canonicalize = "none"
    pixels = torch.from_numpy(np.stack([preprocess(path, model.config) for path in photo_files(photos)]))
    with torch.no_grad():
        predicted = model(pixels).logits.argmax(1).tolist()
    right = sum(str(label) == path.parent.name for label, path in zip(predicted, photo_files(photos)))
    assert right <= 3
