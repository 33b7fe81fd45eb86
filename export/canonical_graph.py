"""`vit_hub.processing.canonical`'s digit canonicalisation as ONNX operators, for `pipeline.onnx`.

Each function here is the one of the same name in canonical.py, step for step and with its
constants, so the two can be read side by side; `graph_numpy` stands in for what canonical.py
takes from NumPy, SciPy and Pillow. Where canonical.py raises EmptyImageError, the graph
stops with an onnxruntime error that quotes the same message (`GraphBuilder.guard`).

Values: an image plane is [h, w] (float32 for the full-size picture, doubles for the small
copies, as NumPy holds them); a Paper is its six surface coefficients and typical ink.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vit_hub.processing import canonical as c

from .graph_builder import BOOL, DOUBLE, FLOAT, INT64, GraphBuilder, as_double, dims, f64, grid, positions, vector
from .graph_numpy import (EIGHT, FOUR, block_reduce, by_label, ceil_div, count_pieces, dilate, disk, erode, fill_holes,
                          label, masked_mean_std, median, middle_pair, percentile, reduce_mean, resample,
                          truncate)


def centre_digit(g: GraphBuilder, gray: str, size: tuple[int, int]) -> str:
    """Gray levels float32 [H, W] -> the digit framed like MNIST, float32 [height, width] of
    whole gray levels (canonical.centre_digit)."""
    signal, work = ink_signal(g, gray)
    paper = Paper.of(g, work)
    shape = stroke_shape(g, signal, paper, _ink_box(g, signal.gray, work, paper))
    return _centre_by_mass(g, _fit_to_box(g, with_stroke_width(g, shape), size), size)


@dataclass(frozen=True)
class Signal:
    """canonical.ink_signal's picture, kept as the gray levels [H, W] and whether to invert
    them (dark ink on paper): only the crop that holds the digit is ever inverted."""

    gray: str
    inverting: str  # bool scalar

    def crop(self, g: GraphBuilder, top: str, left: str, bottom: str, right: str) -> str:
        part = g.Slice(self.gray, vector(g, top, left), vector(g, bottom, right), g.const([0, 1]))
        return g.Where(self.inverting, g.Sub(g.const(255.0), part), part)


def ink_signal(g: GraphBuilder, gray: str) -> tuple[Signal, str]:
    """(the picture with its ink bright, its shrunk copy doubles [h, w]) (canonical.ink_signal)."""
    height, width = dims(g, gray)
    factor = g.Max(g.Div(g.Max(height, width), g.const(c.WORK_SIDE)), g.const(1))
    middle = median(g, g.Reshape(reduce_mean(g, gray, factor), g.const([-1])), levels=True)
    shrunk = _shrunk_both_ways(g, gray, c.WORK_SIDE)  # [2, h, w]: inverted, as it is
    shrunk_inverted, shrunk_gray = (g.Gather(shrunk, g.const(index), axis=0) for index in (0, 1))
    darkest = g.Sub(f64(g, 255.0), percentile(g, g.Reshape(shrunk_inverted, g.const([-1])), c.EXTREME_PERCENTILE,
                                                 levels=True))
    brightest = percentile(g, g.Reshape(shrunk_gray, g.const([-1])), c.EXTREME_PERCENTILE, levels=True)
    dark_ink, light_ink = g.Sub(middle, darkest), g.Sub(brightest, middle)
    dark_ink = g.guard(dark_ink, g.GreaterOrEqual(g.Max(dark_ink, light_ink), f64(g, c.MIN_CONTRAST)), c.BLANK_IMAGE)
    inverting = g.Greater(dark_ink, light_ink)
    return Signal(gray, inverting), g.Where(inverting, shrunk_inverted, shrunk_gray)


def _shrunk_both_ways(g: GraphBuilder, gray: str, longest: int) -> str:
    """shrink() of the inverted and of the plain gray levels at once, doubles [2, h, w]: the
    brightest of each block of the inverted picture is 255 minus the darkest of the plain one."""
    height, width = dims(g, gray)
    larger = g.Max(height, width)
    block = g.Max(ceil_div(g, larger, g.const(longest)), g.const(1))
    blocks = g.Concat(*(g.Unsqueeze(block_reduce(g, gray, block, reduction), g.const([0]))
                        for reduction in ("ReduceMin", "ReduceMax")), axis=0)
    inverted_first = g.Mul(g.Sub(blocks, g.const(np.array([255.0, 0.0], np.float32).reshape(2, 1, 1))),
                           g.const(np.array([-1.0, 1.0], np.float32).reshape(2, 1, 1)))
    return _shrunk_blocks(g, inverted_first, height, width, longest)


def shrink(g: GraphBuilder, signal: str, longest: int) -> str:
    """float32 [H, W] -> doubles whose longer side is `longest` (or as it is, if smaller): the
    brightest of each whole block of pixels, then Pillow's bilinear resize to the exact size."""
    height, width = dims(g, signal)
    block = g.Max(ceil_div(g, g.Max(height, width), g.const(longest)), g.const(1))
    blocks = g.Unsqueeze(block_reduce(g, signal, block, "ReduceMax"), g.const([0]))
    return g.Squeeze(_shrunk_blocks(g, blocks, height, width, longest), g.const([0]))


def _shrunk_blocks(g: GraphBuilder, blocks: str, height: str, width: str, longest: int) -> str:
    """Block maxima float32 [n, h', w'] of a picture [height, width] -> doubles resized to
    the size shrink() gives (the picture as it is when it is no larger than `longest`)."""
    larger = g.Max(height, width)

    def resized(t: GraphBuilder) -> list[str]:
        scale = t.Div(f64(t, longest), as_double(t, larger))
        new_height, new_width = (t.Max(t.Cast(t.Round(t.Mul(as_double(t, side), scale)), to=INT64), t.const(1))
                                 for side in (height, width))
        return [resample(t, t.Cast(blocks, to=DOUBLE), new_height, new_width, "bilinear", eight_bit=True)]

    return g.cond(g.Greater(larger, g.const(longest)), [DOUBLE], resized, lambda t: [t.Cast(blocks, to=DOUBLE)])[0]


@dataclass(frozen=True)
class Paper:
    """canonical.Paper: the paper's surface (6 coefficients) and the ink's typical contrast."""

    surface: str
    typical_ink: str

    @classmethod
    def of(cls, g: GraphBuilder, signal: str) -> "Paper":
        height, width = dims(g, signal)
        basis = _quadratic_basis(g, *_unit_grid(g, height, width, (0.0, 0.0), (1.0, 1.0)))  # [6, n]
        values = g.Reshape(signal, g.const([-1]))
        chosen = g.LessOrEqual(values, median(g, values, levels=True))  # whole gray levels
        for _ in range(2):  # refit once without the pixels far above the first fit
            surface = _least_squares(g, basis, values, chosen)
            residual = g.Sub(values, _surface_at(g, basis, surface))
            _, spread = masked_mean_std(g, residual, chosen)
            middle = middle_pair(g, residual)  # what percentile(residual, 50) and median(residual) read
            chosen = g.LessOrEqual(residual, g.Add(percentile(g, residual, 50, pair=middle), g.Mul(f64(g, 2.0), spread)))
        noise = g.Mul(f64(g, 1.4826), median(g, g.Abs(g.Sub(residual, median(g, residual, pair=middle)))))
        stands_out = g.Greater(residual, g.Max(f64(g, c.MIN_CONTRAST), g.Mul(f64(g, c.NOISE_MARGIN), noise)))
        found = g.Cast(g.ReduceMax(g.Cast(stands_out, to=INT64), keepdims=0), to=BOOL)
        residual = g.guard(residual, found, c.NO_INK)
        return cls(surface, median(g, _upper_class(g, g.Compress(residual, stands_out))))

    def ink(self, g: GraphBuilder, signal: str, top_left: tuple[str, str], extent: tuple[str, str]) -> str:
        """Ink strength doubles [h, w] in [0, 1] of a part of the picture (Paper.ink)."""
        height, width = dims(g, signal)
        y, x = _unit_grid(g, height, width, top_left, extent)
        contrast = g.Sub(g.Reshape(signal, g.const([-1])), _surface_at(g, _quadratic_basis(g, y, x), self.surface))
        ink = g.Reshape(g.Clip(g.Div(contrast, self.typical_ink), f64(g, 0.0), f64(g, 1.0)), g.Shape(signal))
        return g.Where(g.Less(ink, f64(g, c.INK_LEVEL)), f64(g, 0.0), ink)


def _surface_at(g: GraphBuilder, basis: str, surface: str) -> str:
    """surface [6] @ basis [6, n], as six products summed in order (onnxruntime's matrix-vector
    product in doubles is slow), each a row of the basis times one coefficient."""
    return g.ReduceSum(g.Mul(basis, g.Unsqueeze(surface, g.const([1]))), g.const([0]), keepdims=0)  # [n]


def _least_squares(g: GraphBuilder, basis: str, values: str, chosen: str) -> str:
    """np.linalg.lstsq(basis.T[chosen], values[chosen]) by the normal equations, solved by
    Gauss-Jordan elimination (6 unknowns; a whisker of ridge keeps a degenerate fit finite,
    near the least-norm answer lstsq gives)."""
    weighted = g.Mul(basis, g.Unsqueeze(g.Cast(chosen, to=DOUBLE), g.const([0])))  # [6, n]: 0 where not chosen
    normal = g.MatMul(weighted, g.Transpose(basis))  # [6, 6]
    ridge = g.Mul(g.ReduceSum(g.Mul(normal, g.const(np.eye(6), np.float64)), keepdims=0), f64(g, 1e-13))
    normal = g.Add(normal, g.Mul(g.const(np.eye(6), np.float64), ridge))
    right = g.MatMul(weighted, g.Unsqueeze(values, g.const([1])))  # [6, 1]
    system = g.Concat(normal, right, axis=1)  # [6, 7]
    for pivot in range(6):  # each row less its multiple of the pivot's row, the pivot's row divided by its pivot
        row = g.Gather(system, g.const([pivot]), axis=0)  # [1, 7]
        row = g.Div(row, g.Gather(row, g.const([pivot]), axis=1))
        column = g.Sub(g.Gather(system, g.const([pivot]), axis=1), g.const(np.eye(6)[:, [pivot]], np.float64))  # [6, 1]
        system = g.Sub(system, g.Mul(column, row))
    return g.Squeeze(g.Slice(system, g.const([6]), g.const([7]), g.const([1])), g.const([1]))  # [6]


def _upper_class(g: GraphBuilder, values: str) -> str:
    """The values [n] above Otsu's split of their 64-bin histogram (canonical._upper_class); all
    of them when their range is too narrow to bin."""
    low, high = g.ReduceMin(values, keepdims=0), g.ReduceMax(values, keepdims=0)
    bins = 64
    edges = g.Add(g.Mul(g.const(np.arange(bins + 1), np.float64), g.Div(g.Sub(high, low), f64(g, bins))), low)
    edges = g.Concat(g.Slice(edges, g.const([0]), g.const([bins])), g.Unsqueeze(high, g.const([0])), axis=0)  # np.linspace
    index = g.Cast(g.Mul(g.Div(g.Sub(values, low), g.Sub(high, low)), f64(g, bins)), to=INT64)
    index = g.Clip(index, g.const(0), g.const(bins - 1))
    index = g.Sub(index, g.Cast(g.Less(values, g.Gather(edges, index)), to=INT64))  # NumPy's corrections at the edges
    index = g.Add(index, g.Cast(g.And(g.GreaterOrEqual(values, g.Gather(edges, g.Add(index, g.const(1)))),
                                      g.Less(index, g.const(bins - 1))), to=INT64))
    counts = g.ScatterElements(g.const(np.zeros(bins), np.float64), index, g.Expand(f64(g, 1.0), g.Shape(index)),
                               reduction="add")  # [64]
    centres = g.Div(g.Add(g.Slice(edges, g.const([0]), g.const([bins])), g.Slice(edges, g.const([1]), g.const([bins + 1]))),
                    f64(g, 2.0))
    total = g.ReduceSum(counts, keepdims=0)
    below = g.Slice(g.CumSum(counts, g.const(0)), g.const([0]), g.const([bins - 1]))  # [63]
    above = g.Sub(total, below)
    weighted = g.CumSum(g.Mul(counts, centres), g.const(0))
    mean_below = g.Div(g.Slice(weighted, g.const([0]), g.const([bins - 1])), g.Max(below, f64(g, 1.0)))
    mean_above = g.Div(g.Sub(g.ReduceSum(g.Mul(counts, centres), keepdims=0), g.Slice(weighted, g.const([0]), g.const([bins - 1]))),
                       g.Max(above, f64(g, 1.0)))
    gap = g.Sub(mean_below, mean_above)
    best = g.ArgMax(g.Mul(g.Mul(below, above), g.Mul(gap, gap)), axis=0, keepdims=0)
    split = g.Gather(g.Slice(edges, g.const([1]), g.const([bins])), best)
    split = g.Where(g.Less(g.Sub(high, low), f64(g, 1e-6)), f64(g, -np.inf), split)
    return g.Compress(values, g.Greater(values, split))


def _unit_grid(g: GraphBuilder, height: str, width: str, top_left, extent) -> tuple[str, str]:
    """Pixel centres of a [h, w] grid covering `extent` of the picture from `top_left`, flat y
    and x in [-0.5, 0.5], computed in canonical._unit_grid's order."""
    rows, cols = grid(g, height, width)
    top, left = (f64(g, value) if isinstance(value, float) else value for value in top_left)
    tall, wide = (f64(g, value) if isinstance(value, float) else value for value in extent)
    y = g.Sub(g.Add(top, g.Mul(g.Div(g.Add(rows, f64(g, 0.5)), as_double(g, height)), tall)), f64(g, 0.5))
    x = g.Sub(g.Add(left, g.Mul(g.Div(g.Add(cols, f64(g, 0.5)), as_double(g, width)), wide)), f64(g, 0.5))
    return g.Reshape(y, g.const([-1])), g.Reshape(x, g.const([-1]))


def _quadratic_basis(g: GraphBuilder, y: str, x: str) -> str:
    """canonical._quadratic_basis transposed: [6, n], a row per term, as the graph's products read it."""
    rows = [g.Add(g.Mul(x, f64(g, 0.0)), f64(g, 1.0)), x, y, g.Mul(x, x), g.Mul(x, y), g.Mul(y, y)]
    return g.Concat(*(g.Unsqueeze(row, g.const([0])) for row in rows), axis=0)  # [6, n]


def _extent(g: GraphBuilder, mask: str) -> tuple[str, str, str, str]:
    """(first row, last row, first column, last column) of a mask's pixels, as doubles."""
    inked = g.Cast(mask, to=FLOAT)
    extent = []
    for axis, side in enumerate(dims(g, mask)):
        lines = g.Greater(g.ReduceMax(inked, g.const([1 - axis]), keepdims=0), g.const(0.0))  # [side] rows or columns inked
        index = positions(g, side)
        extent += [g.ReduceMin(g.Where(lines, index, f64(g, np.inf)), keepdims=0),
                   g.ReduceMax(g.Where(lines, index, f64(g, -np.inf)), keepdims=0)]
    return tuple(extent)


def _ink_box(g: GraphBuilder, gray: str, work: str, paper: Paper) -> tuple[str, str, str, str]:
    """Where the digit is: (top, left, bottom, right) int64 pixels of the picture (canonical._ink_box)."""
    height, width = dims(g, gray)
    work_height, work_width = dims(g, work)
    ink = _without_outliers(g, _without_frame_marks(g, paper.ink(g, work, (0.0, 0.0), (1.0, 1.0))))
    first_row, last_row, first_col, last_col = _extent(g, g.Greater(ink, f64(g, 0.0)))
    scale_y = g.Div(as_double(g, height), as_double(g, work_height))
    scale_x = g.Div(as_double(g, width), as_double(g, work_width))
    one = f64(g, 1.0)
    ink_side = g.Max(g.Mul(g.Add(g.Sub(last_row, first_row), one), scale_y), g.Mul(g.Add(g.Sub(last_col, first_col), one), scale_x))
    least = g.Max(f64(g, float(c.MIN_INK_SIDE)), g.Mul(f64(g, c.MIN_INK_SHARE), as_double(g, g.Max(height, width))))
    first_row = g.guard(first_row, g.GreaterOrEqual(ink_side, least), c.NEARLY_BLANK)
    margin = g.Mul(f64(g, c.CROP_MARGIN), g.Max(g.Add(g.Sub(last_row, first_row), one), g.Add(g.Sub(last_col, first_col), one)))
    top = g.Max(truncate(g, g.Mul(g.Sub(first_row, margin), scale_y)), f64(g, 0.0))
    left = g.Max(truncate(g, g.Mul(g.Sub(first_col, margin), scale_x)), f64(g, 0.0))
    bottom = g.Min(g.Ceil(g.Mul(g.Add(g.Add(last_row, one), margin), scale_y)), as_double(g, height))
    right = g.Min(g.Ceil(g.Mul(g.Add(g.Add(last_col, one), margin), scale_x)), as_double(g, width))
    return tuple(g.Cast(value, to=INT64) for value in (top, left, bottom, right))


def _without_frame_marks(g: GraphBuilder, ink: str) -> str:
    """Ink doubles [h, w] without the marks of the picture's frame (canonical._without_frame_marks)."""
    height, width = dims(g, ink)
    inked = g.Greater(ink, f64(g, 0.0))
    ends = g.const([0, -1])
    on_edge = g.Or(_any(g, g.Gather(inked, ends, axis=0)), _any(g, g.Gather(inked, ends, axis=1)))

    def without_marks(t: GraphBuilder) -> list[str]:
        rows, cols = grid(t, height, width)
        edges = [t.Equal(rows, f64(t, 0.0)), t.Equal(rows, t.Sub(as_double(t, height), f64(t, 1.0))),
                 t.Equal(cols, f64(t, 0.0)), t.Equal(cols, t.Sub(as_double(t, width), f64(t, 1.0)))]  # top, bottom, left, right
        labels = label(t, inked, EIGHT)
        frame = t.And(inked, _frame_pieces(t, labels, rows, cols, edges, height, width))
        sizes = by_label(t, labels, t.Cast(inked, to=DOUBLE))
        stroke_ink = t.ReduceSum(t.Cast(t.And(inked, t.Not(frame)), to=DOUBLE), keepdims=0)
        stroke = t.And(t.And(inked, t.Not(frame)), t.GreaterOrEqual(sizes, t.Mul(f64(t, c.SPECK_SHARE), stroke_ink)))
        touched = t.ReduceSum(t.Concat(*(t.Unsqueeze(t.Cast(_any(t, t.And(stroke, edge)), to=INT64), t.const([0]))
                                         for edge in edges), axis=0), keepdims=0)
        keep_all = t.Or(t.Or(t.Not(_any(t, t.And(inked, t.Not(frame)))), t.Not(_any(t, frame))),
                        t.GreaterOrEqual(touched, t.const(2)))
        return [t.Where(t.Or(keep_all, t.Not(frame)), ink, f64(t, 0.0))]

    # every frame mark touches the picture's edge: without ink there, there is none to find
    return g.cond(_any(g, on_edge), [DOUBLE], without_marks, lambda t: [t.Identity(ink)])[0]


def _any(g: GraphBuilder, mask: str) -> str:
    return g.Cast(g.ReduceMax(g.Cast(mask, to=INT64), keepdims=0), to=BOOL)


def _frame_pieces(g: GraphBuilder, labels: str, rows: str, cols: str, edges: list[str], height: str, width: str) -> str:
    """Per pixel: whether its piece is a mark of the frame (canonical._frame_pieces)."""
    tall, wide = as_double(g, height), as_double(g, width)
    one = f64(g, 1.0)
    span = lambda index: g.Add(g.Add(by_label(g, labels, index, "max"), by_label(g, labels, g.Neg(index), "max")), one)  # noqa: E731
    piece_height, piece_width = span(rows), span(cols)
    top, bottom, left, right = (g.Div(by_label(g, labels, g.Cast(edge, to=DOUBLE)), side)
                                for edge, side in zip(edges, (wide, wide, tall, tall)))
    along = g.Max(top, bottom, left, right)
    long_side = g.GreaterOrEqual(along, f64(g, c.FRAME_SIDE_SHARE))
    across = g.And(g.Equal(piece_width, wide), g.Or(g.Less(piece_height, g.Mul(f64(g, c.RULED_LINE_SHARE), tall)), long_side))
    down = g.And(g.Equal(piece_height, tall), g.Or(g.Less(piece_width, g.Mul(f64(g, c.RULED_LINE_SHARE), wide)), long_side))
    corner = g.Max(*(g.Min(side, end) for side in (left, right) for end in (top, bottom)))
    return g.Or(g.Or(across, down), g.GreaterOrEqual(corner, f64(g, c.CORNER_SIDE_SHARE)))


def stroke_shape(g: GraphBuilder, signal: Signal, paper: Paper, box: tuple[str, str, str, str]) -> str:
    """The digit inside `box` -> its ink as a bool shape cropped tight (canonical.stroke_shape)."""
    top, left, bottom, right = box
    height, width = dims(g, signal.gray)
    crop = signal.crop(g, top, left, bottom, right)
    crop_height, crop_width = g.Sub(bottom, top), g.Sub(right, left)
    scale = g.Div(f64(g, c.DETAIL_SIDE), as_double(g, g.Max(crop_height, crop_width)))

    def enlarged(t: GraphBuilder) -> list[str]:
        new_height, new_width = (t.Max(t.Cast(t.Round(t.Mul(as_double(t, side), scale)), to=INT64), t.const(1))
                                 for side in (crop_height, crop_width))
        plane = t.Unsqueeze(t.Cast(crop, to=DOUBLE), t.const([0]))
        return [t.Cast(t.Squeeze(resample(t, plane, new_height, new_width, "bicubic", eight_bit=True), t.const([0])),
                       to=FLOAT)]

    crop = g.cond(g.Greater(scale, f64(g, 1.0)), [FLOAT], enlarged, lambda t: [t.Identity(crop)])[0]
    top_left = (g.Div(as_double(g, top), as_double(g, height)), g.Div(as_double(g, left), as_double(g, width)))
    extent = (g.Div(as_double(g, crop_height), as_double(g, height)), g.Div(as_double(g, crop_width), as_double(g, width)))
    ink = paper.ink(g, shrink(g, crop, c.DETAIL_SIDE), top_left, extent)
    return _crop_tight(g, _without_specks(g, g.Greater(_without_outliers(g, ink), f64(g, 0.0))))


def _crop_tight(g: GraphBuilder, shape: str) -> str:
    first_row, last_row, first_col, last_col = (g.Cast(value, to=INT64) for value in _extent(g, shape))
    return g.Slice(shape, vector(g, first_row, first_col), vector(g, g.Add(last_row, g.const(1)), g.Add(last_col, g.const(1))),
                   g.const([0, 1]))


def stroke_width(g: GraphBuilder, shape: str) -> str:
    """The mean width of a bool shape's strokes (canonical.stroke_width), a double."""
    area = g.ReduceSum(g.Cast(shape, to=DOUBLE), keepdims=0)
    peeled = g.Sub(area, g.ReduceSum(g.Cast(erode(g, shape), to=DOUBLE), keepdims=0))
    return g.Div(g.Mul(f64(g, 2.0), area), g.Max(peeled, f64(g, 1.0)))


def with_stroke_width(g: GraphBuilder, shape: str) -> str:
    """Thicken or thin a bool shape's strokes to STROKE_SHARE of its longer side (canonical.with_stroke_width)."""
    height, width = dims(g, shape)
    target = g.Mul(f64(g, c.STROKE_SHARE), as_double(g, g.Max(height, width)))
    grow = g.Cast(g.Round(g.Div(g.Sub(target, stroke_width(g, shape)), f64(g, 2.0))), to=INT64)

    def thicker(t: GraphBuilder) -> list[str]:
        holes = t.And(fill_holes(t, shape), t.Not(shape))
        hole_area = by_label(t, label(t, holes, FOUR), t.Cast(holes, to=DOUBLE))
        large = t.And(holes, t.GreaterOrEqual(hole_area, t.Mul(f64(t, c.MIN_HOLE_SHARE), as_double(t, t.Mul(height, width)))))
        pads = vector(t, grow, grow, grow, grow)
        grown = dilate(t, t.Pad(shape, pads, t.const(False), mode="constant"), disk(t, grow), grow)
        return [t.And(grown, t.Not(t.Pad(large, pads, t.const(False), mode="constant")))]

    def thinner(t: GraphBuilder) -> list[str]:
        pieces = count_pieces(t, label(t, shape, FOUR))

        def peel(u: GraphBuilder, state: list[str], _step: str) -> tuple[str, list[str]]:
            peeled = erode(u, state[0])
            same = u.Equal(count_pieces(u, label(u, peeled, FOUR)), pieces)
            return same, [u.Or(u.And(same, peeled), u.And(u.Not(same), state[0]))]  # no bool Where in onnxruntime

        return t.loop(t.Max(t.Neg(grow), t.const(0)), [(shape, BOOL)], peel)

    return g.cond(g.Greater(grow, g.const(0)), [BOOL], thicker, thinner)[0]


def _without_specks(g: GraphBuilder, shape: str) -> str:
    """A bool shape without its specks (canonical._without_specks)."""
    bridged = dilate(g, shape, g.const(c._disk(c.SPECK_GAP).astype(np.float32)), c.SPECK_GAP)
    labels = g.Where(shape, label(g, bridged, EIGHT), g.const(0.0))
    areas = by_label(g, labels, g.Cast(shape, to=DOUBLE))
    total = g.ReduceSum(g.Cast(shape, to=DOUBLE), keepdims=0)
    return g.And(shape, g.GreaterOrEqual(areas, g.Mul(f64(g, c.SPECK_SHARE), total)))


def _without_outliers(g: GraphBuilder, ink: str) -> str:
    """Ink doubles [h, w] far from its centre of mass set to 0 (canonical._without_outliers)."""
    height, width = dims(g, ink)
    mass = g.ReduceSum(ink, keepdims=0)
    mass = g.guard(mass, g.Greater(mass, f64(g, 0.0)), c.NO_INK)
    keep = None
    for position in (g.Unsqueeze(positions(g, height), g.const([1])), g.Unsqueeze(positions(g, width), g.const([0]))):
        # [h, 1] row indices, then [1, w] column indices: np.indices' planes, broadcast
        centre = g.Div(g.ReduceSum(g.Mul(position, ink), keepdims=0), mass)
        offset = g.Sub(position, centre)
        spread = g.Sqrt(g.Div(g.ReduceSum(g.Mul(g.Mul(offset, offset), ink), keepdims=0), mass))
        near = g.LessOrEqual(g.Abs(offset), g.Add(g.Mul(f64(g, c.OUTLIER_SPREAD), spread), f64(g, 1.0)))
        keep = near if keep is None else g.And(keep, near)
    return g.Where(keep, ink, f64(g, 0.0))


def _fit_to_box(g: GraphBuilder, shape: str, size: tuple[int, int]) -> str:
    """A bool shape scaled into the digit's box, Pillow's BOX filter on a float image (canonical._fit_to_box)."""
    shape = _crop_tight(g, shape)
    height, width = dims(g, shape)
    box_height, box_width = c.digit_box(size)
    scale = g.Min(g.Div(f64(g, box_height), as_double(g, height)), g.Div(f64(g, box_width), as_double(g, width)))
    new_height, new_width = (g.Max(g.Cast(g.Round(g.Mul(as_double(g, side), scale)), to=INT64), g.const(1))
                             for side in (height, width))
    plane = g.Unsqueeze(g.Mul(g.Cast(shape, to=DOUBLE), f64(g, 255.0)), g.const([0]))
    scaled = g.Squeeze(resample(g, plane, new_height, new_width, "box", eight_bit=False), g.const([0]))
    return g.Cast(g.Clip(scaled, f64(g, 0.0), f64(g, 255.0)), to=FLOAT)


def _centre_by_mass(g: GraphBuilder, ink: str, size: tuple[int, int]) -> str:
    """float32 ink [h, w] pasted into a black [height, width] canvas, its centre of mass in the middle."""
    height, width = size
    ink_height, ink_width = dims(g, ink)
    rows, cols = grid(g, ink_height, ink_width)
    weights = as_double(g, ink)
    mass = g.Cast(g.ReduceSum(ink, keepdims=0), to=DOUBLE)  # NumPy sums the float32 ink in float32
    offsets = []
    for position, frame, side in ((rows, height, ink_height), (cols, width, ink_width)):
        centre = g.Div(g.ReduceSum(g.Mul(position, weights), keepdims=0), mass)
        start = g.Clip(g.Round(g.Sub(f64(g, frame / 2), centre)), f64(g, 0.0), as_double(g, g.Sub(g.const(frame), side)))
        offsets.append(g.Cast(start, to=INT64))
    top, left = offsets
    pads = vector(g, top, left, g.Sub(g.Sub(g.const(height), top), ink_height), g.Sub(g.Sub(g.const(width), left), ink_width))
    return g.Round(g.Pad(ink, pads, g.const(0.0), mode="constant"))
