"""Bring an input into the model's domain before the usual resize and normalisation.

A model trained on MNIST has only ever seen light digits on black, cropped to the ink,
scaled to 20 of 28 pixels and centred by mass, drawn with a pen about a tenth as wide as
the digit is tall. A phone photo of a digit on paper, or a hairline drawn in a paint program
on a large canvas, is none of that, so the config can record how inputs are brought into
that domain (`ViTConfig.canonicalize`), and `preprocess.to_model_domain` applies it on every
path: training, evaluation, prediction, ONNX Runtime and the app. Torch-free (PIL, NumPy,
SciPy's ndimage).

    "none"   the image as it is
    "digit"  what MNIST's makers did to NIST's scans, redone on any picture: ink polarity read
             from the image, the paper's uneven light flattened, ink found by its contrast
             with the paper, cropped to the ink, drawn as a binary shape with MNIST's stroke
             width, scaled so its longer side fills 20/28 of the frame (anti-aliased by the
             scaling, as MNIST's were), centred by mass

Ink is found twice: on the whole picture, shrunk so no side exceeds WORK_SIDE, to find where
the digit is; then on the original pixels inside that box, shrunk to DETAIL_SIDE, to draw it.
Shrinking keeps the most inked pixel of each block (not the average), so a 1 px pen line on
a 1000 px canvas keeps its full contrast instead of fading into the paper.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image
from scipy import ndimage

from vit_hub.errors import UserError

DIGIT_BOX_SHARE = 20 / 28  # MNIST: the digit's box is 20x20 inside 28x28
WORK_SIDE = 256  # the whole picture is searched for ink at most this large
DETAIL_SIDE = 80  # the digit's longer side when its strokes are set (4x MNIST's 20 px box)
STROKE_SHARE = 0.147  # MNIST: median stroke_width / longer side, 1,000 training digits (quartiles 0.127-0.173)
MIN_CONTRAST = 24  # gray levels: ink fainter than this against its paper is no ink
NOISE_MARGIN = 5.0  # ink stands this many noise deviations above the paper
INK_LEVEL = 0.4  # share of the digit's typical ink darkness that is still ink (not show-through)
EXTREME_PERCENTILE = 99.99  # the darkest or brightest marks: a few pixels of a 256x256 copy
OUTLIER_SPREAD = 2.5  # ink further from the centre of mass (in standard deviations) is dust
SPECK_SHARE = 0.03  # a separate piece with less of the ink than this is a speck, not a stroke
SPECK_GAP = 2  # pixels (at DETAIL_SIDE) between dashes of one stroke
MIN_HOLE_SHARE = 0.005  # a loop's hole this share of the digit's box or larger stays open
RULED_LINE_SHARE = 0.15  # an edge-to-edge piece thinner than this share of the picture is a ruled line
FRAME_SIDE_SHARE = 0.5  # an edge-to-edge piece along this share of a side or more is the desk or a shadow
CORNER_SIDE_SHARE = 0.3  # a piece along this share of two sides that meet fills a corner: the desk
CROP_MARGIN = 0.05  # the detail crop's margin around the ink box, as a share of its longer side
# Ink whose longer side spans fewer pixels of the picture than either of these is a speck, not a
# digit: a lone dark pixel on white. The uploads people make span 22-71 % of the picture (bench
# digit_uploads' photos and typed digits, digits on paper, the MNIST samples; the smallest 48 px).
MIN_INK_SIDE = 4  # pixels
MIN_INK_SHARE = 0.025  # of the picture's longer side

BLANK_IMAGE = "expected an image of a digit, found a blank image (no ink)"
NO_INK = "expected an image of a digit, found no ink standing out from the background"
NEARLY_BLANK = "expected an image of a digit, found a nearly blank image (a speck of ink too small to be a digit)"


class EmptyImageError(UserError):
    """The image holds no ink to canonicalise (a blank page, an empty drawing)."""


def centre_digit(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """A grayscale ("L") image of one digit -> a light-on-black digit of `size` (height,
    width), framed like MNIST. `preprocess.to_model_mode(image, 1)` gives any image that mode."""
    if image.mode != "L":
        raise ValueError(f"expected a grayscale (L) image, got mode {image.mode}; convert it with to_model_mode")
    signal, work = _signal_and_work(image)
    paper = Paper.of(work)
    shape = stroke_shape(signal, paper, _ink_box(signal, work, paper))
    return _centre_by_mass(_fit_to_box(with_stroke_width(shape), size), size)


def ink_signal(gray: Image.Image) -> Image.Image:
    """Gray levels -> the same picture with the ink bright ("L"): dark ink on paper is inverted.

    The paper is the majority of pixels (the median); the ink is whichever of the darkest and
    the brightest marks lies further from it. Those are read on copies shrunk by block minima
    and maxima, so a hairline on a large canvas counts as much as a marker stroke."""
    return _signal_and_work(gray)[0]


def _signal_and_work(gray: Image.Image) -> tuple[Image.Image, np.ndarray]:
    """(`ink_signal` of gray levels, its copy shrunk to WORK_SIDE [h, w]): the shrunk copy read
    for the ink's polarity is the one the paper and the ink box are found on, so the full-size
    picture is shrunk twice (inverted and as it is), not once more for each of them."""
    median = float(np.median(np.asarray(gray.reduce(max(1, max(gray.size) // WORK_SIDE)))))
    inverted = gray.point(lambda level: 255 - level)
    shrunk_inverted, shrunk_gray = shrink(inverted, WORK_SIDE), shrink(gray, WORK_SIDE)
    darkest = 255 - np.percentile(shrunk_inverted, EXTREME_PERCENTILE)
    brightest = np.percentile(shrunk_gray, EXTREME_PERCENTILE)
    if max(median - darkest, brightest - median) < MIN_CONTRAST:
        raise EmptyImageError(BLANK_IMAGE)
    return (inverted, shrunk_inverted) if median - darkest > brightest - median else (gray, shrunk_gray)


def shrink(signal: Image.Image, longest: int) -> np.ndarray:
    """An ink-bright "L" image -> float gray levels [h, w] whose longer side is `longest` (or
    less, if it is smaller), each pixel the brightest (the most inked) of the block it
    replaces, so a hairline keeps its contrast; blocks of a whole number of pixels, then a
    smooth enlargement to the exact size."""
    factor = max(signal.size) / longest
    if factor <= 1:
        return np.asarray(signal, dtype=np.float32)
    block = int(np.ceil(factor))
    array = np.asarray(signal)
    height, width = (-(-side // block) * block for side in array.shape)  # padded up to whole blocks
    array = np.pad(array, ((0, height - array.shape[0]), (0, width - array.shape[1])), mode="edge")
    blocks = Image.fromarray(array.reshape(height // block, block, width // block, block).max(axis=(1, 3)))
    scale = longest / max(signal.size)
    size = (max(1, round(signal.width * scale)), max(1, round(signal.height * scale)))
    return np.asarray(blocks.resize(size, Image.Resampling.BILINEAR), dtype=np.float32)


@dataclass(frozen=True)
class Paper:
    """What the paper looks like in an ink-bright picture, and how strong its ink is.

    The paper's brightness is a smooth surface fitted to the pixels below the median (the
    paper; the ink is the bright minority), so a gradient of light across a photo is not ink.
    What stands above that surface by more than the paper's own noise (NOISE_MARGIN
    deviations) and MIN_CONTRAST is marked; the marks may be two kinds (pen and the lines of
    squared paper, or pen and what shows through from the back of the page), so the ink's
    typical contrast is the median of the stronger kind (Otsu's split of the marks)."""

    surface: np.ndarray  # coefficients of a + bx + cy + dx^2 + exy + fy^2, x and y in [-0.5, 0.5]
    typical_ink: float

    @classmethod
    def of(cls, signal: np.ndarray) -> "Paper":
        """Fit the paper of a whole ink-bright picture [h, w]."""
        basis = _quadratic_basis(*_unit_grid(signal.shape, (0, 0), (1, 1)))
        values = signal.ravel()
        chosen = values <= np.median(values)
        for _ in range(2):  # refit once without the pixels far above the first fit
            surface, *_ = np.linalg.lstsq(basis[chosen], values[chosen], rcond=None)
            residual = values - basis @ surface
            chosen = residual <= np.percentile(residual, 50) + 2.0 * residual[chosen].std()
        noise = 1.4826 * np.median(np.abs(residual - np.median(residual)))  # the paper's own deviation
        stands_out = residual > max(MIN_CONTRAST, NOISE_MARGIN * noise)
        if not stands_out.any():
            raise EmptyImageError(NO_INK)
        return cls(surface, float(np.median(_upper_class(residual[stands_out]))))

    def ink(self, signal: np.ndarray, top_left: tuple[float, float], extent: tuple[float, float]) -> np.ndarray:
        """Ink strength [h, w] in [0, 1] of a part of the picture: `signal` covers `extent`
        (height, width) of the picture from `top_left`, both as shares of the whole. Ink at its
        typical contrast is 1; what reaches less than INK_LEVEL of it (marks showing through
        the page, the lines of squared paper) is 0."""
        y, x = _unit_grid(signal.shape, top_left, extent)
        contrast = signal.ravel() - _quadratic_basis(y, x) @ self.surface
        ink = np.clip(contrast / self.typical_ink, 0.0, 1.0).reshape(signal.shape)
        ink[ink < INK_LEVEL] = 0.0
        return ink


def _upper_class(values: np.ndarray) -> np.ndarray:
    """The values above Otsu's threshold: the split of a histogram into two classes with the
    largest variance between their means. Marks all of one contrast (a drawing in two grey
    levels) are one class, and a histogram of a range that narrow cannot be binned."""
    if np.ptp(values) < 1e-6:
        return values
    counts, edges = np.histogram(values, bins=64)
    centres = (edges[:-1] + edges[1:]) / 2
    below = np.cumsum(counts)[:-1]  # [63] values below each candidate split
    above = values.size - below
    mean_below = np.cumsum(counts * centres)[:-1] / np.maximum(below, 1)
    mean_above = (np.sum(counts * centres) - np.cumsum(counts * centres)[:-1]) / np.maximum(above, 1)
    split = edges[1:-1][np.argmax(below * above * (mean_below - mean_above) ** 2)]
    return values[values > split]


def _unit_grid(shape: tuple[int, int], top_left, extent) -> tuple[np.ndarray, np.ndarray]:
    """Pixel centres of a [h, w] grid covering `extent` of the picture from `top_left` (shares
    of the whole), as flat y and x coordinates in [-0.5, 0.5]."""
    rows, cols = np.mgrid[0:shape[0], 0:shape[1]]
    y = top_left[0] + (rows.ravel() + 0.5) / shape[0] * extent[0] - 0.5
    x = top_left[1] + (cols.ravel() + 0.5) / shape[1] * extent[1] - 0.5
    return y, x


def _quadratic_basis(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    return np.stack([np.ones_like(x), x, y, x * x, x * y, y * y], axis=1)  # [n, 6]


def _ink_box(signal: Image.Image, work: np.ndarray, paper: Paper) -> tuple[int, int, int, int]:
    """Where the digit is in an ink-bright picture: (top, left, bottom, right) in its pixels,
    found on `work`, its copy shrunk to WORK_SIDE, without specks of dust far from the ink's mass,
    with a margin of CROP_MARGIN of its longer side. Ink spanning fewer than MIN_INK_SIDE pixels,
    or less than MIN_INK_SHARE of the picture's longer side, is no digit (EmptyImageError)."""
    rows, cols = np.nonzero(_without_outliers(_without_frame_marks(paper.ink(work, (0, 0), (1, 1)))))
    scale_y, scale_x = signal.height / work.shape[0], signal.width / work.shape[1]
    ink_side = max((np.ptp(rows) + 1) * scale_y, (np.ptp(cols) + 1) * scale_x)  # in the picture's pixels
    if ink_side < max(MIN_INK_SIDE, MIN_INK_SHARE * max(signal.size)):
        raise EmptyImageError(NEARLY_BLANK)
    margin = CROP_MARGIN * max(np.ptp(rows) + 1, np.ptp(cols) + 1)
    top, left = max(0, int((rows.min() - margin) * scale_y)), max(0, int((cols.min() - margin) * scale_x))
    bottom = min(signal.height, int(np.ceil((rows.max() + 1 + margin) * scale_y)))
    right = min(signal.width, int(np.ceil((cols.max() + 1 + margin) * scale_x)))
    return top, left, bottom, right


def _without_frame_marks(ink: np.ndarray) -> np.ndarray:
    """Ink [h, w] without its frame marks (`_frame_pieces`), unless nothing else is left or
    the rest, specks aside, reaches two sides of the picture: a digit is photographed inside
    the frame, and one cropped tight touches its edges."""
    if not (ink[[0, -1]].any() or ink[:, [0, -1]].any()):
        return ink  # every frame mark touches the picture's edge
    labels, count = ndimage.label(ink > 0, structure=np.ones((3, 3)))
    edges = (labels[0], labels[-1], labels[:, 0], labels[:, -1])  # top, bottom, left, right
    frame = np.concatenate([[False], _frame_pieces(labels, count, edges)])  # [count + 1], 0 the background
    if frame[1:].all() or not frame.any():
        return ink
    sizes = np.bincount(labels.ravel(), minlength=count + 1)  # [count + 1] pixels per piece
    stroke = ~frame & (sizes >= SPECK_SHARE * sizes[1:][~frame[1:]].sum())
    stroke[0] = False
    if sum(bool(stroke[edge].any()) for edge in edges) >= 2:
        return ink
    return np.where(frame[labels], 0.0, ink)


def _frame_pieces(labels: np.ndarray, count: int, edges: tuple[np.ndarray, ...]) -> np.ndarray:
    """Which of `count` labelled pieces [count] are marks of the frame, not the digit: those
    that cross the whole picture from edge to edge and are either thin (a ruled line, the
    paper's edge) or lie along half a side or more (the desk beyond the paper, a shadow band),
    and those along 30 % of two sides that meet (the desk where the page is turned)."""
    pieces = np.arange(1, count + 1)
    rows, cols = np.indices(labels.shape)
    height = ndimage.maximum(rows, labels, pieces) - ndimage.minimum(rows, labels, pieces) + 1  # [count]
    width = ndimage.maximum(cols, labels, pieces) - ndimage.minimum(cols, labels, pieces) + 1
    top, bottom, left, right = (np.bincount(edge, minlength=count + 1)[1:] / edge.size for edge in edges)
    along = np.max([top, bottom, left, right], axis=0)  # [count] the longest stretch of one side
    across = (width == labels.shape[1]) & ((height < RULED_LINE_SHARE * labels.shape[0]) | (along >= FRAME_SIDE_SHARE))
    down = (height == labels.shape[0]) & ((width < RULED_LINE_SHARE * labels.shape[1]) | (along >= FRAME_SIDE_SHARE))
    corner = np.max([np.minimum(side, end) for side in (left, right) for end in (top, bottom)], axis=0)
    return across | down | (corner >= CORNER_SIDE_SHARE)


def stroke_shape(signal: Image.Image, paper: Paper, box: tuple[int, int, int, int]) -> np.ndarray:
    """The digit inside `box` of an ink-bright picture -> its ink as a binary shape [h, w] whose
    longer side is about DETAIL_SIDE, cropped tight. Smaller crops are enlarged smoothly first,
    so MNIST's 20 px digits get round strokes rather than blocks."""
    top, left, bottom, right = box
    crop = signal.crop((left, top, right, bottom))
    scale = DETAIL_SIDE / max(crop.size)
    if scale > 1:
        crop = crop.resize((max(1, round(crop.width * scale)), max(1, round(crop.height * scale))),
                           Image.Resampling.BICUBIC)
    extent = ((bottom - top) / signal.height, (right - left) / signal.width)
    ink = paper.ink(shrink(crop, DETAIL_SIDE), (top / signal.height, left / signal.width), extent)
    shape = _without_specks(_without_outliers(ink) > 0)
    rows, cols = np.nonzero(shape)
    return shape[rows.min():rows.max() + 1, cols.min():cols.max() + 1]


def stroke_width(shape: np.ndarray) -> float:
    """The mean width of a binary shape's strokes, in pixels: its area over its length, where
    one erosion peels about one pixel off each side of a stroke, so the pixels it removes are
    twice the length. A stroke too thin to survive one erosion measures 2."""
    area = shape.sum()
    peeled = area - ndimage.binary_erosion(shape).sum()
    return float(2 * area / max(peeled, 1))


def with_stroke_width(shape: np.ndarray) -> np.ndarray:
    """Thicken or thin a binary shape's strokes to STROKE_SHARE of its longer side (a round pen
    drawn along them, or peeled a pixel a side at a time until a stroke would break). A pen
    thickened never fills a loop: holes of at least MIN_HOLE_SHARE of the shape's box stay
    open (the small triangle of a closed-top 4 is not a 9's filled loop)."""
    grow = round((STROKE_SHARE * max(shape.shape) - stroke_width(shape)) / 2)
    if grow > 0:
        holes = ndimage.binary_fill_holes(shape) & ~shape
        labels, count = ndimage.label(holes)
        large = np.concatenate([[False], np.bincount(labels.ravel())[1:] >= MIN_HOLE_SHARE * shape.size])
        shape = ndimage.binary_dilation(np.pad(shape, grow), structure=_disk(grow)) & ~np.pad(large[labels], grow)
    pieces = ndimage.label(shape)[1]
    for _ in range(-grow):
        thinner = ndimage.binary_erosion(shape)
        if ndimage.label(thinner)[1] != pieces:
            break
        shape = thinner
    return shape


def _disk(radius: int) -> np.ndarray:
    rows, cols = np.mgrid[-radius:radius + 1, -radius:radius + 1]
    return rows**2 + cols**2 <= radius**2 + radius  # + radius: rounder for small radii


def _without_specks(shape: np.ndarray) -> np.ndarray:
    """A binary shape without its specks: pieces (gaps of up to SPECK_GAP pixels bridged, so
    a faint stroke broken into dashes stays one piece) holding less than SPECK_SHARE of the ink."""
    bridged = ndimage.binary_dilation(shape, structure=_disk(SPECK_GAP))
    labels = np.where(shape, ndimage.label(bridged, structure=np.ones((3, 3)))[0], 0)
    areas = np.bincount(labels.ravel())[1:]  # [count]
    keep = np.concatenate([[False], areas >= SPECK_SHARE * areas.sum()])
    return keep[labels]


def _without_outliers(ink: np.ndarray) -> np.ndarray:
    """Ink more than OUTLIER_SPREAD standard deviations from the centre of mass (per axis)
    set to 0. A digit's own ink lies within 1.8 of them even when spread evenly."""
    mass = ink.sum()
    if mass <= 0:
        raise EmptyImageError(NO_INK)
    rows, cols = np.indices(ink.shape)
    keep = np.ones(ink.shape, dtype=bool)
    for position in (rows, cols):
        centre = (position * ink).sum() / mass
        spread = np.sqrt(((position - centre) ** 2 * ink).sum() / mass)
        keep &= np.abs(position - centre) <= OUTLIER_SPREAD * spread + 1
    return np.where(keep, ink, 0.0)


def _fit_to_box(shape: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Scale a binary [h, w] shape so its longer side fills DIGIT_BOX_SHARE of `size`, keeping
    its aspect; averaging over the pixels each output pixel covers gives MNIST's grey edges."""
    rows, cols = np.nonzero(shape)
    shape = shape[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
    box_h, box_w = digit_box(size)
    scale = min(box_h / shape.shape[0], box_w / shape.shape[1])
    new_h, new_w = max(1, round(shape.shape[0] * scale)), max(1, round(shape.shape[1] * scale))
    image = Image.fromarray(shape.astype(np.float32) * 255.0)
    return np.clip(np.asarray(image.resize((new_w, new_h), Image.Resampling.BOX)), 0.0, 255.0)


def digit_box(size: tuple[int, int]) -> tuple[int, int]:
    """The box (height, width) a digit's longer side is scaled to fill in a frame of `size`."""
    return tuple(max(1, round(side * DIGIT_BOX_SHARE)) for side in size)


def _centre_by_mass(ink: np.ndarray, size: tuple[int, int]) -> Image.Image:
    """Paste [h, w] ink into a black canvas of `size`, its centre of mass in the middle."""
    height, width = size
    rows, cols = np.indices(ink.shape)
    mass = ink.sum()
    centre_row, centre_col = (rows * ink).sum() / mass, (cols * ink).sum() / mass
    top = int(np.clip(round(height / 2 - centre_row), 0, height - ink.shape[0]))
    left = int(np.clip(round(width / 2 - centre_col), 0, width - ink.shape[1]))
    canvas = np.zeros((height, width), dtype=np.float32)
    canvas[top:top + ink.shape[0], left:left + ink.shape[1]] = ink
    return Image.fromarray(canvas.round().astype(np.uint8))
