"""What `vit_hub.processing.canonical` and `vit_hub.processing.preprocess` take from NumPy,
SciPy and Pillow, written as ONNX operators, each to give the same numbers as the library it stands for: medians and
percentiles as NumPy takes them, Pillow's resampling filters and `reduce`, SciPy's connected
pieces, dilation, erosion and filled holes. `pipeline_graph` and `canonical_graph` build on them.

Conventions: `g` is a `GraphBuilder`; an image plane is a 2-D tensor [h, w]; sizes are int64
scalars; a mask is a bool tensor. Connected pieces are found by letting each inked pixel take
the largest index among its neighbours (MaxPools) and jump along the chains those indices
make (Gathers) until nothing changes (a Loop), so a piece's label is the largest flat index
in it plus one.
"""

from __future__ import annotations

import math

import numpy as np

from .graph_builder import DOUBLE, FLOAT, INT64, GraphBuilder, as_double, dims, grid, positions, vector

PIL_PRECISION_BITS = 22  # Pillow's fixed-point resampling of 8-bit images: 32 - 8 - 2 bits
HOOK_STEPS = 2  # neighbour steps per loop turn when labelling pieces
JUMP_STEPS = 1  # ... and jumps along the labels' chains after them
ROW_BLOCK = 256  # rows of a large picture converted and resampled at a time (bounds its memory)


# Order statistics --------------------------------------------------------------------------
SELECT_BINS = 4096  # buckets of the first pass when picking one value by its rank
GRAY_LEVELS = 256  # the values of an 8-bit picture


def select_pair(g: GraphBuilder, values: str, rank: str) -> tuple[str, str]:
    """The values at 0-based positions `rank` and rank + 1 (int64) of a 1-D double tensor sorted
    ascending, without sorting it all: count the values into SELECT_BINS buckets of their range,
    find the buckets that hold the two ranks, and sort only what lies in them (unless their
    values are all equal). Past the end, the second is the first."""
    low, high = g.ReduceMin(values, keepdims=0), g.ReduceMax(values, keepdims=0)
    span = g.Sub(high, low)
    scale = g.Div(g.const(float(SELECT_BINS), np.float64), g.Where(g.Greater(span, g.const(0.0, np.float64)), span,
                                                                     g.const(1.0, np.float64)))
    bucket_of = g.Clip(g.Cast(g.Mul(g.Sub(values, low), scale), to=INT64), g.const(0), g.const(SELECT_BINS - 1))  # floor: >= 0
    counts = g.ScatterElements(g.const(np.zeros(SELECT_BINS, dtype=np.int64)), bucket_of,
                               g.Expand(g.const(1), g.Shape(bucket_of)), reduction="add")
    below_or_in = g.CumSum(counts, g.const(0))
    bucket_at = lambda at: g.ArgMax(g.Cast(g.Greater(below_or_in, at), to=INT64), axis=0, keepdims=0)  # noqa: E731
    first = bucket_at(rank)
    last = g.Max(bucket_at(g.Add(rank, g.const(1))), first)  # none holds a rank past the end: 0
    before = g.Sub(g.Gather(below_or_in, first), g.Gather(counts, first))
    inside = g.And(g.GreaterOrEqual(bucket_of, first), g.LessOrEqual(bucket_of, last))
    smallest = g.ReduceMin(g.Where(inside, values, g.const(np.inf, np.float64)), keepdims=0)
    largest = g.ReduceMax(g.Where(inside, values, g.const(-np.inf, np.float64)), keepdims=0)

    def sorted_buckets(t: GraphBuilder) -> list[str]:
        members = t.Compress(values, inside)
        ordered = t.TopK(members, t.Shape(members), outputs=2, largest=0, sorted=1)[0]
        at = t.Min(t.Sub(vector(t, rank, t.Add(rank, t.const(1))), before), t.Sub(t.Size(members), t.const(1)))
        picked = t.Gather(ordered, at)  # [2]
        return [t.Gather(picked, t.const(0)), t.Gather(picked, t.const(1))]

    return tuple(g.cond(g.Equal(smallest, largest), [DOUBLE, DOUBLE],
                        lambda t: [t.Identity(smallest), t.Identity(smallest)], sorted_buckets))


def order_pair(g: GraphBuilder, values: str, rank: str, levels: bool = False) -> tuple[str, str]:
    """(the value at 0-based `rank` of a 1-D double tensor sorted ascending, the one at rank + 1).
    With `levels`, the values are whole gray levels 0-255 (an 8-bit picture, its shrunk copies,
    its reduction): both are read off one 256-bin histogram, with no bucket to sort."""
    if not levels:
        return select_pair(g, values, rank)
    index = g.Cast(values, to=INT64)
    ones = g.Expand(g.const(1), g.Shape(index))
    counts = g.ScatterElements(g.const(np.zeros(GRAY_LEVELS, dtype=np.int64)), index, ones, reduction="add")  # [256]
    below_or_at = g.CumSum(counts, g.const(0))  # [256] values at or below each level
    level_of = lambda at: g.Cast(g.ArgMax(g.Cast(g.Greater(below_or_at, at), to=INT64), axis=0, keepdims=0),  # noqa: E731
                                 to=DOUBLE)  # the first level with more than `at` values at or below it
    return level_of(rank), level_of(g.Add(rank, g.const(1)))


def middle_pair(g: GraphBuilder, values: str, levels: bool = False) -> tuple[str, str]:
    """`order_pair` at the middle rank, (size - 1) // 2: what both np.median and np.percentile(50) read."""
    return order_pair(g, values, g.Div(g.Sub(g.Size(values), g.const(1)), g.const(2)), levels)


def median(g: GraphBuilder, values: str, levels: bool = False, pair: tuple[str, str] | None = None) -> str:
    """np.median of a 1-D double tensor: the middle value, or the mean of the middle two
    (`levels`: whole gray levels, see `order_pair`; `pair`: their `middle_pair`, read already)."""
    count = g.Size(values)
    lower, upper = pair or middle_pair(g, values, levels)
    upper = g.Where(g.Equal(g.Mod(count, g.const(2)), g.const(1)), lower, upper)
    return g.Div(g.Add(lower, upper), g.const(2.0, np.float64))


def percentile(g: GraphBuilder, values: str, q: float, levels: bool = False, pair: tuple[str, str] | None = None) -> str:
    """np.percentile(values, q) of a 1-D double tensor, NumPy's linear method to the last bit
    (`levels`: whole gray levels, see `order_pair`; `pair`: the `middle_pair` read already, q = 50)."""
    last = g.Sub(g.Cast(g.Size(values), to=DOUBLE), g.const(1.0, np.float64))
    virtual = g.Mul(g.const(np.true_divide(q, 100), np.float64), last)
    previous = g.Floor(virtual)
    low, high = pair or order_pair(g, values, g.Cast(previous, to=INT64), levels)
    high = g.Where(g.Less(previous, last), high, low)
    gamma = g.Sub(virtual, previous)
    step = g.Sub(high, low)
    from_low = g.Add(low, g.Mul(step, gamma))
    from_high = g.Sub(high, g.Mul(step, g.Sub(g.const(1.0, np.float64), gamma)))
    return g.Where(g.GreaterOrEqual(gamma, g.const(0.5, np.float64)), from_high, from_low)


def masked_mean_std(g: GraphBuilder, values: str, mask: str) -> tuple[str, str]:
    """(mean, np.std) of values[mask], 1-D doubles."""
    weight = g.Cast(mask, to=DOUBLE)
    count = g.ReduceSum(weight, keepdims=0)
    mean = g.Div(g.ReduceSum(g.Mul(values, weight), keepdims=0), count)
    spread = g.Div(g.ReduceSum(g.Mul(g.Mul(g.Sub(values, mean), g.Sub(values, mean)), weight), keepdims=0), count)
    return mean, g.Sqrt(spread)


# Pillow's resampling -----------------------------------------------------------------------
FILTER_SUPPORT = {"box": 0.5, "bilinear": 1.0, "hamming": 1.0, "bicubic": 2.0, "lanczos": 3.0}  # Pillow's


def _filter(g: GraphBuilder, name: str, t: str) -> str:
    """Pillow's filter of `name` at offsets t (doubles) -> weights."""
    one = g.const(1.0, np.float64)
    size = g.Abs(t)
    if name == "box":
        inside = g.And(g.Greater(t, g.const(-0.5, np.float64)), g.LessOrEqual(t, g.const(0.5, np.float64)))
        return g.Cast(inside, to=DOUBLE)
    if name == "bilinear":
        return g.Max(g.Sub(one, size), g.const(0.0, np.float64))
    if name == "bicubic":  # Pillow's a = -0.5
        a = -0.5
        near = g.Add(g.Mul(g.Sub(g.Mul(g.const(a + 2, np.float64), size), g.const(a + 3, np.float64)),
                           g.Mul(size, size)), one)
        far = g.Mul(g.Sub(g.Mul(g.Add(g.Mul(g.Sub(size, g.const(5.0, np.float64)), size), g.const(8.0, np.float64)),
                                size), g.const(4.0, np.float64)), g.const(a, np.float64))
        return g.Where(g.Less(size, one), near,
                       g.Where(g.Less(size, g.const(2.0, np.float64)), far, g.const(0.0, np.float64)))
    if name in ("hamming", "lanczos"):
        support = FILTER_SUPPORT[name]
        window = (g.Add(g.const(0.54, np.float64), g.Mul(g.const(0.46, np.float64), g.Cos(g.Mul(t, g.const(math.pi, np.float64)))))
                  if name == "hamming" else _sinc(g, g.Div(t, g.const(3.0, np.float64))))
        inside = g.Less(size, g.const(support, np.float64))
        return g.Where(inside, g.Mul(_sinc(g, t), window), g.const(0.0, np.float64))
    raise ValueError(f"expected one of Pillow's filters box, bilinear, bicubic, hamming, lanczos, got {name!r}")


def _sinc(g: GraphBuilder, t: str) -> str:
    angle = g.Mul(t, g.const(math.pi, np.float64))
    zero = g.Equal(t, g.const(0.0, np.float64))
    return g.Where(zero, g.const(1.0, np.float64), g.Div(g.Sin(angle), g.Where(zero, g.const(1.0, np.float64), angle)))


def resample_window(g: GraphBuilder, size_in: str, size_out: str, name: str, eight_bit: bool) -> tuple[str, str]:
    """Pillow's coefficients for resizing one axis (precompute_coeffs): each output pixel
    weighs the inputs within the filter's support around its centre (scaled when shrinking),
    normalised to sum 1, for 8-bit images rounded to PIL_PRECISION_BITS fixed point. As
    (input index int64 [out, K], weight doubles [out, K]), K the widest window."""
    if name == "nearest":
        return _nearest_window(g, size_in, size_out, eight_bit)
    scale = g.Div(as_double(g, size_in), as_double(g, size_out))
    filter_scale = g.Max(scale, g.const(1.0, np.float64))
    centre = g.Unsqueeze(g.Mul(g.Add(positions(g, size_out), g.const(0.5, np.float64)), scale), g.const([1]))  # [out, 1]
    reach = g.Mul(g.const(FILTER_SUPPORT[name], np.float64), filter_scale)
    first = g.Max(truncate(g, g.Add(g.Sub(centre, reach), g.const(0.5, np.float64))), g.const(0.0, np.float64))
    end = g.Min(truncate(g, g.Add(g.Add(centre, reach), g.const(0.5, np.float64))), as_double(g, size_in))
    widest = g.Cast(g.ReduceMax(g.Sub(end, first), keepdims=0), to=INT64)
    inputs = g.Add(first, g.Unsqueeze(positions(g, widest), g.const([0])))  # [out, K]
    weights = _filter(g, name, g.Div(g.Add(g.Sub(inputs, centre), g.const(0.5, np.float64)), filter_scale))
    weights = g.Mul(weights, g.Cast(g.Less(inputs, end), to=DOUBLE))
    total = g.ReduceSum(weights, g.const([1]), keepdims=1)
    weights = g.Div(weights, g.Where(g.Equal(total, g.const(0.0, np.float64)), g.const(1.0, np.float64), total))
    if eight_bit:  # Pillow rounds half away from zero
        fixed = g.Mul(weights, g.const(float(1 << PIL_PRECISION_BITS), np.float64))
        weights = g.Mul(g.Sign(fixed), g.Floor(g.Add(g.Abs(fixed), g.const(0.5, np.float64))))
    index = g.Cast(g.Min(inputs, g.Sub(as_double(g, size_in), g.const(1.0, np.float64))), to=INT64)
    return index, weights


def _nearest_window(g: GraphBuilder, size_in: str, size_out: str, eight_bit: bool) -> tuple[str, str]:
    """Pillow's NEAREST as a window of one input of weight 1: the input under each output
    pixel's centre, the centres found as Pillow finds them (half a step, then adding a step
    at a time, in doubles)."""
    step = g.Div(as_double(g, size_in), as_double(g, size_out))
    steps = g.Expand(step, g.Unsqueeze(size_out, g.const([0])))  # [out]
    first = g.Concat(g.Mul(g.Unsqueeze(step, g.const([0])), g.const([0.5], np.float64)),
                     g.Slice(steps, g.const([1]), g.Unsqueeze(size_out, g.const([0]))), axis=0)
    index = g.Min(g.Cast(g.Floor(g.CumSum(first, g.const(0))), to=INT64), g.Sub(size_in, g.const(1)))
    one = float(1 << PIL_PRECISION_BITS) if eight_bit else 1.0
    return g.Unsqueeze(index, g.const([1])), g.Expand(g.const([[one]], np.float64), vector(g, size_out, g.const(1)))


def truncate(g: GraphBuilder, value: str) -> str:
    """C's (int) and Python's int() of a double: towards zero."""
    return g.Mul(g.Sign(value), g.Floor(g.Abs(value)))


def resample_pass(g: GraphBuilder, pixels: str, window: tuple[str, str], eight_bit: bool, axis: int = -1) -> str:
    """One resampling pass along the last axis (`axis` -1: [..., in] -> [..., out]) or the one
    before it (-2: [..., in, w] -> [..., out, w]), of float32 or doubles, as doubles."""
    index, weights = window  # [out, K]
    windows = g.Cast(g.Gather(pixels, index, axis=axis), to=DOUBLE)  # [..., out, K] or [..., out, K, w]
    if axis == -2:
        weights = g.Unsqueeze(weights, g.const([2]))  # [out, K, 1]
    total = g.ReduceSum(g.Mul(windows, weights), g.const([axis]), keepdims=0)
    if not eight_bit:  # Pillow keeps "F" images in float32 between passes
        return g.Cast(g.Cast(total, to=FLOAT), to=DOUBLE)
    half = g.const(float(1 << (PIL_PRECISION_BITS - 1)), np.float64)
    unit = g.const(float(1 << PIL_PRECISION_BITS), np.float64)
    return g.Clip(g.Floor(g.Div(g.Add(total, half), unit)), g.const(0.0, np.float64), g.const(255.0, np.float64))


def resample(g: GraphBuilder, pixels: str, height: str, width: str, name: str, eight_bit: bool) -> str:
    """Image.resize((width, height), filter) of [channels, h, w] (float32 or doubles), as
    doubles: Pillow's two passes, the width first, each output pixel from the inputs in its
    filter's window; with `eight_bit`, rounded and clipped to 0-255 after each pass as Pillow
    does for "L" and "RGB" images (else as for "F" images)."""
    old_height, old_width = _last_two(g, pixels)
    across = resample_pass(g, pixels, resample_window(g, old_width, width, name, eight_bit), eight_bit)
    return resample_down(g, across, old_height, height, name, eight_bit)


def resample_down(g: GraphBuilder, across: str, old_height: str, height: str, name: str, eight_bit: bool) -> str:
    """The second pass of `resample`, along the height of [channels, h, out width]."""
    return resample_pass(g, across, resample_window(g, old_height, height, name, eight_bit), eight_bit, axis=-2)


def _last_two(g: GraphBuilder, pixels: str) -> tuple[str, str]:
    """(height, width) of [channels, h, w]."""
    shape = g.Shape(pixels)
    return tuple(g.Squeeze(g.Slice(shape, g.const([axis]), g.const([axis + 1])), g.const([0])) for axis in (1, 2))


def by_row_blocks(g: GraphBuilder, image: str, rows: str, rank: int, convert, kind: int) -> str:
    """convert(g, block) for each block of ROW_BLOCK rows of `image` (rows on axis 0, `rank`
    axes), the results (rows first, of element type `kind`) joined again: a large picture
    costs memory for one block at a time. The last block is padded to ROW_BLOCK rows and its
    padding's results cut off."""

    def block(t: GraphBuilder, _state: list[str], step: str) -> tuple:
        start = t.Unsqueeze(t.Mul(step, t.const(ROW_BLOCK)), t.const([0]))
        part = t.Slice(image, start, t.Add(start, t.const([ROW_BLOCK])), t.const([0]))
        missing = t.Sub(t.const([ROW_BLOCK]), t.Slice(t.Shape(part), t.const([0]), t.const([1])))
        pads = t.Concat(t.const([0] * rank), missing, t.const([0] * (rank - 1)), axis=0)
        return t.const(True), [], [convert(t, t.Pad(part, pads))]

    stacked = g.loop(ceil_div(g, rows, g.const(ROW_BLOCK)), [], block, scans=[kind])[0]  # [blocks, ROW_BLOCK, ...]
    joined = g.Reshape(stacked, g.Concat(g.const([-1]), g.Slice(g.Shape(stacked), g.const([2]), g.const([2**62])), axis=0))
    return g.Slice(joined, g.const([0]), g.Unsqueeze(rows, g.const([0])), g.const([0]))


def reduce_mean(g: GraphBuilder, plane: str, factor: str) -> str:
    """Image.reduce(factor) of an 8-bit plane float32 [h, w], as doubles: the rounded mean of
    each factor x factor block, the edge blocks over the pixels they have, with Pillow's
    fixed-point division (a multiplier of 2^24 // count); the plane as it is for factor 1."""
    return g.cond(g.Equal(factor, g.const(1)), [DOUBLE], lambda t: [as_double(t, plane)],
                  lambda t: [_block_means(t, plane, factor)])[0]


def _block_means(g: GraphBuilder, plane: str, factor: str) -> str:
    total = as_double(g, block_reduce(g, plane, factor, "ReduceSum", pad_value=0.0))
    height, width = dims(g, plane)
    rows, cols = (g.Min(g.Sub(side, g.Mul(positions(g, ceil_div(g, side, factor), INT64), factor)), factor)
                  for side in (height, width))  # pixels in each block's rows and columns
    count = as_double(g, g.Mul(g.Unsqueeze(rows, g.const([1])), g.Unsqueeze(cols, g.const([0]))))
    multiplier = g.Floor(g.Div(g.const(float(1 << 24), np.float64), count))
    amended = g.Add(total, g.Floor(g.Div(count, g.const(2.0, np.float64))))
    return g.Floor(g.Div(g.Mul(amended, multiplier), g.const(float(1 << 24), np.float64)))


def ceil_div(g: GraphBuilder, size: str, factor: str) -> str:
    """ceil(size / factor) of int64 scalars."""
    return g.Div(g.Sub(g.Add(size, factor), g.const(1)), factor)


def block_reduce(g: GraphBuilder, plane: str, factor: str, reduction: str, pad_value: float | None = None) -> str:
    """Each factor x factor block of a plane [h, w] -> one value (`reduction`: "ReduceSum",
    "ReduceMax"); the last blocks padded with `pad_value`, or with their edge pixels."""
    height, width = dims(g, plane)
    padded_height, padded_width = (g.Mul(ceil_div(g, side, factor), factor) for side in (height, width))
    pads = vector(g, g.const(0), g.const(0), g.Sub(padded_height, height), g.Sub(padded_width, width))
    if pad_value is None:
        padded = g.Pad(plane, pads, mode="edge")
    else:
        padded = g.Pad(plane, pads, g.CastLike(g.const(pad_value), plane), mode="constant")
    blocks = g.Reshape(padded, vector(g, g.Div(padded_height, factor), factor, g.Div(padded_width, factor), factor))
    return g.op(reduction, blocks, g.const([1, 3]), keepdims=0)


# SciPy's ndimage ---------------------------------------------------------------------------
EIGHT = np.ones((3, 3), dtype=bool)  # ndimage's structure=np.ones((3, 3)): corners connect
FOUR = np.array([[0, 1, 0], [1, 1, 1], [0, 1, 0]], dtype=bool)  # ndimage's default: edges only


def _image4(g: GraphBuilder, plane: str) -> str:
    return g.Unsqueeze(plane, g.const([0, 1]))  # [1, 1, h, w]


def _plane(g: GraphBuilder, image4: str) -> str:
    return g.Squeeze(image4, g.const([0, 1]))


def _neighbour_max(g: GraphBuilder, values4: str, structure: np.ndarray) -> str:
    """Largest value among each pixel's neighbours by `structure` (EIGHT or FOUR), [1, 1, h, w]."""
    if structure.all():
        return g.MaxPool(values4, kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    return g.Max(g.MaxPool(values4, kernel_shape=[3, 1], pads=[1, 0, 1, 0]),
                 g.MaxPool(values4, kernel_shape=[1, 3], pads=[0, 1, 0, 1]))


def label(g: GraphBuilder, mask: str, structure: np.ndarray) -> str:
    """ndimage.label's pieces as float labels [h, w]: 0 outside the mask, and within each piece
    its largest flat index + 1 (not numbered 1, 2, ... but one label a piece all the same).

    Each pixel starts with its own index + 1; each turn it takes the largest label among its
    neighbours (HOOK_STEPS times), then jumps: a label names a pixel of the same piece (the one
    at label - 1), whose label is at least as large, so each pixel takes that one (JUMP_STEPS
    times). A jump doubles how far a label has travelled along a chain, so a long stroke takes
    a few turns, not one per pixel of its length; the turns stop when nothing grows."""
    height, width = dims(g, mask)
    index = g.Add(positions(g, g.Mul(height, width), FLOAT), g.const(1.0))  # [h * w]
    mask4 = _image4(g, mask)
    zero = g.const(0.0)
    start = _image4(g, g.Where(mask, g.Reshape(index, vector(g, height, width)), zero))

    def turn(inner: GraphBuilder, state: list[str], _step: str) -> tuple[str, list[str]]:
        current = labels = state[0]
        for _ in range(HOOK_STEPS):
            labels = inner.Where(mask4, _neighbour_max(inner, labels, structure), zero)
        flat = inner.Reshape(labels, inner.const([-1]))  # [h * w]
        for _ in range(JUMP_STEPS):  # slot 0 is the background's label, 0
            flat = inner.Gather(inner.Concat(inner.const([0.0]), flat, axis=0), inner.Cast(flat, to=INT64))
        labels = inner.Reshape(flat, inner.Shape(current))
        changed = inner.Greater(inner.ReduceMax(inner.Sub(labels, current), keepdims=0), zero)
        return changed, [labels]

    (final,) = g.loop(g.Mul(height, width), [(start, FLOAT)], turn)
    return _plane(g, final)


def count_pieces(g: GraphBuilder, labels: str) -> str:
    """How many pieces `label` found (its second return value in ndimage): the pixels that
    carry their own index as their label."""
    height, width = dims(g, labels)
    index = g.Reshape(g.Add(positions(g, g.Mul(height, width), FLOAT), g.const(1.0)), vector(g, height, width))
    return g.ReduceSum(g.Cast(g.Equal(labels, index), to=INT64), keepdims=0)


def by_label(g: GraphBuilder, labels: str, values: str, reduction: str = "add") -> str:
    """For each pixel, the sum ("add") or the largest ("max") of `values` (doubles [h, w]) over
    its piece (np.bincount with weights, or ndimage.maximum, read back per pixel)."""
    flat = g.Cast(g.Reshape(labels, g.const([-1])), to=INT64)
    start = g.const([0.0 if reduction == "add" else -np.inf], np.float64)
    slots = g.Concat(g.Add(g.Mul(g.Cast(flat, to=DOUBLE), g.const(0.0, np.float64)), start), start,
                     axis=0)  # one per label: 0 (the background) to the pixel count
    totals = g.ScatterElements(slots, flat, g.Reshape(values, g.const([-1])), reduction=reduction)
    return g.Reshape(g.Gather(totals, flat), g.Shape(labels))


def convolve_count(g: GraphBuilder, mask: str, kernel: str, radius: str | int) -> str:
    """How many pixels of `mask` each pixel's `kernel` (float [k, k], k = 2 radius + 1) covers,
    outside the image counting as empty: float [h, w]."""
    radius = g.const(radius) if isinstance(radius, int) else radius
    pads = vector(g, g.const(0), g.const(0), radius, radius, g.const(0), g.const(0), radius, radius)
    padded = g.Pad(_image4(g, g.Cast(mask, to=FLOAT)), pads, g.const(0.0), mode="constant")
    return _plane(g, g.Conv(padded, g.Unsqueeze(kernel, g.const([0, 1]))))


def dilate(g: GraphBuilder, mask: str, kernel: str, radius: str | int) -> str:
    """ndimage.binary_dilation(mask, structure=kernel)."""
    return g.Greater(convolve_count(g, mask, kernel, radius), g.const(0.5))


def erode(g: GraphBuilder, mask: str) -> str:
    """ndimage.binary_erosion(mask): a pixel stays if it and its four neighbours are inked
    (outside the image counts as empty)."""
    return g.Greater(convolve_count(g, mask, g.const(FOUR.astype(np.float32)), 1), g.const(4.5))


def disk(g: GraphBuilder, radius: str) -> str:
    """canonical._disk(radius) as float [2r + 1, 2r + 1], for a radius known only at run time."""
    offsets = g.Cast(g.Range(g.Neg(radius), g.Add(radius, g.const(1)), g.const(1)), to=FLOAT)
    squares = g.Mul(offsets, offsets)
    distance = g.Add(g.Unsqueeze(squares, g.const([1])), g.Unsqueeze(squares, g.const([0])))
    limit = g.Cast(g.Add(g.Mul(radius, radius), radius), to=FLOAT)
    return g.Cast(g.LessOrEqual(distance, limit), to=FLOAT)


def fill_holes(g: GraphBuilder, mask: str) -> str:
    """ndimage.binary_fill_holes(mask): the background that no edge-connected path of
    background joins to the image's border is filled."""
    height, width = dims(g, mask)
    rows, cols = grid(g, height, width, FLOAT)
    last_row, last_col = (g.Cast(g.Sub(side, g.const(1)), to=FLOAT) for side in (height, width))
    border = g.Or(g.Or(g.Equal(rows, g.const(0.0)), g.Equal(cols, g.const(0.0))),
                  g.Or(g.Equal(rows, last_row), g.Equal(cols, last_col)))
    background = g.Not(mask)
    pieces = label(g, background, FOUR)  # of the background
    reaching = by_label(g, pieces, g.Cast(border, to=DOUBLE), "max")  # [h, w] 1 where a piece reaches the border
    return g.Not(g.And(background, g.Greater(reaching, g.const(0.5, np.float64))))
