"""`pipeline.onnx`: a decoded image in, the model's probabilities out, for apps in any language.

    image          uint8 [height, width, channels]: what an image decoder gives (channels 1
                   gray, 2 gray + alpha, 3 RGB, 4 RGBA; EXIF orientation already applied)
    probabilities  float32 [num_classes], in config.json's label order

Inside, the steps `vit_hub.processing.preprocess.preprocess` takes, in the same order and to the same
numbers: alpha over white and the model's colour (Pillow's formulas, exact), the config's
canonicalisation (`canonical_graph`: all of `digit`), the resize with the config's filter
(`graph_numpy.resample`: Pillow's), the normalisation; then the network (the logits graph,
merged in) and a softmax at the config's temperature. Every export checks the graph against
the Python path on real and generated uploads (`verify_pipeline`) and refuses one that
disagrees.

A bad input stops the run with onnxruntime's own error, which quotes the failing check:
an image smaller than 2x2 or over UPLOAD_MAX_PIXELS, a channel count other than 1-4, an
image with no ink for a digit model. A wrong dtype or rank is refused by onnxruntime itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.version_converter
import onnxruntime as ort
from onnx import helper
from PIL import Image

from vit_hub.layout import GRAPH_INPUT, GRAPH_LOGITS, PIPELINE_INPUT, PIPELINE_OUTPUT
from vit_hub.model.config import ViTConfig
from vit_hub.processing import canonical
from vit_hub.processing.postprocess import softmax
from vit_hub.processing.preprocess import MIN_STD, UPLOAD_MAX_PIXELS, pixel_limit, preprocess, to_model_mode

from .canonical_graph import centre_digit
from .graph_builder import DOUBLE, FLOAT, UINT8, GraphBuilder
from .graph_numpy import by_row_blocks, resample_down, resample_pass, resample_window
from .session import ORT_ERRORS, QUIET_RUN, quiet_session_options

# Which decoded channels hold the colour, for 1 to 4 channels (the alpha is the last of 2 or 4).
COLOUR_CHANNELS = np.array([[0, 0, 0], [0, 0, 0], [0, 1, 2], [0, 1, 2]])
PROBABILITY_TOLERANCE = 1e-4  # largest |pipeline.onnx - Python path| accepted per probability
FP16_PROBABILITY_TOLERANCE = 2e-2  # ... for the float16 copy (its network rounds to 11 bits)
PHOTO_PIXELS = 4_000_000  # the largest generated photo
CANVAS = (1280, 720)  # a screenshot-sized drawing canvas (width, height)
VERIFY_IMAGES = 4  # eval images turned into uploads (each in four forms) when an export is checked

WRONG_CHANNELS = "image: expected uint8 pixels [height, width, channels] with 1, 2, 3 or 4 channels"
TOO_SMALL = "image: expected at least 2x2 pixels"
TOO_LARGE = f"image: expected {pixel_limit(UPLOAD_MAX_PIXELS)}"


def preprocessing_graph(config: ViTConfig, with_model_input: bool = False) -> onnx.ModelProto:
    """image uint8 [height, width, channels] -> pixel_values float32 [1, C, H, W], as `preprocess`;
    `with_model_input` adds the output model_input, uint8 [H, W, C]: the image the model saw
    (canonicalised and resized, before the normalisation).
    The full-size picture is read a block of rows at a time (`by_row_blocks`): into gray levels
    for a digit model, into the model's colour and straight through the resize's first pass
    for any other, so a 16-megapixel upload never sits in memory as floats."""
    g = GraphBuilder()
    image, height, width = _checked(g, PIPELINE_INPUT)
    out_height, out_width = config.image_size
    if config.canonicalize == "digit":
        gray = _gray_levels(g, image, height)
        plane = g.Unsqueeze(centre_digit(g, gray, tuple(config.image_size)), g.const([0]))
        # [C, H, W]: centre_digit frames the digit at the model's size, so preprocess.resize leaves it as it is
        sized = plane if config.in_channels == 1 else g.Concat(plane, plane, plane, axis=0)
    else:
        window = resample_window(g, width, g.const(out_width), config.interpolation, eight_bit=True)

        def across(t: GraphBuilder, rows: str) -> str:  # uint8 [rows, w, channels] -> [rows, C, out width]
            pixels = t.Cast(rows, to=FLOAT)
            planes = (t.Unsqueeze(_gray(t, pixels), t.const([1])) if config.in_channels == 1
                      else t.Transpose(_colour(t, pixels), perm=[0, 2, 1]))
            return resample_pass(t, planes, window, eight_bit=True)

        rows_first = by_row_blocks(g, image, height, 3, across, DOUBLE)  # [h, C, out width]
        sized = resample_down(g, g.Transpose(rows_first, perm=[1, 0, 2]), height, g.const(out_height),
                              config.interpolation, eight_bit=True)
    output = g.Unsqueeze(_normalized(g, g.Cast(sized, to=FLOAT), config), g.const([0]))
    outputs = [helper.make_tensor_value_info(output, FLOAT, [1, config.in_channels, out_height, out_width])]
    if with_model_input:  # the resize's output is whole numbers 0-255 already
        seen = g.Cast(g.Transpose(sized, perm=[1, 2, 0]), to=UINT8)
        outputs.append(helper.make_tensor_value_info(seen, UINT8, [out_height, out_width, config.in_channels]))
    return g.model([helper.make_tensor_value_info(PIPELINE_INPUT, UINT8, ["height", "width", "channels"])],
                   outputs, "vit_hub_preprocessing")


def _checked(g: GraphBuilder, image: str) -> tuple[str, str, str]:
    """(the input uint8 [h, w, channels] once its channels and size pass the checks, h, w)."""
    shape = g.Shape(image)
    height, width, channels = (g.Squeeze(g.Slice(shape, g.const([axis]), g.const([axis + 1])), g.const([0]))
                               for axis in range(3))
    shape = g.guard(shape, g.And(g.GreaterOrEqual(channels, g.const(1)), g.LessOrEqual(channels, g.const(4))),
                    WRONG_CHANNELS)
    shape = g.guard(shape, g.And(g.GreaterOrEqual(height, g.const(2)), g.GreaterOrEqual(width, g.const(2))), TOO_SMALL)
    shape = g.guard(shape, g.LessOrEqual(g.Mul(height, width), g.const(UPLOAD_MAX_PIXELS)), TOO_LARGE)
    return g.Reshape(image, shape), height, width  # the checks run first: the reshape waits for them


def _channels(g: GraphBuilder, pixels: str) -> tuple[str, str]:
    """(how many channels, whether one of them is alpha) of [h, w, channels]."""
    count = g.Squeeze(g.Slice(g.Shape(pixels), g.const([2]), g.const([3])), g.const([0]))
    return count, g.Equal(g.Mod(count, g.const(2)), g.const(0))  # 2 (gray + alpha) or 4 (RGBA)


def _colour(g: GraphBuilder, pixels: str) -> str:
    """float32 [h, w, channels] -> RGB float32 [h, w, 3] with any alpha composited over white,
    by Pillow's fixed-point formula (Image.alpha_composite), exact in float32."""
    count, with_alpha = _channels(g, pixels)
    row = g.Sub(count, g.const(1))
    colour = g.cond(g.Equal(count, g.const(3)), [FLOAT], lambda t: [t.Identity(pixels)],  # RGB: no copy to make
                    lambda t: [t.Gather(pixels, t.Gather(t.const(COLOUR_CHANNELS), row), axis=2)])[0]  # [h, w, 3]

    def over_white(t: GraphBuilder) -> list[str]:
        alpha = t.Gather(pixels, t.Unsqueeze(row, t.const([0])), axis=2)  # [h, w, 1]: the last channel
        scaled = t.Add(t.Mul(t.const(128.0), t.Add(t.Mul(colour, alpha), t.Mul(t.const(255.0), t.Sub(t.const(255.0), alpha)))),
                       t.const(16384.0))
        return [t.Floor(t.Div(t.Floor(t.Div(t.Add(t.Floor(t.Div(scaled, t.const(256.0))), scaled), t.const(256.0))),
                              t.const(128.0)))]

    return g.cond(with_alpha, [FLOAT], over_white, lambda t: [t.Identity(colour)])[0]


def _gray_levels(g: GraphBuilder, image: str, height: str) -> str:
    """uint8 [h, w, channels] -> gray levels float32 [h, w]: a gray upload (what the app and
    UploadClassifier.decode give a digit model) is its own gray levels, cast at once; any other
    is converted a block of rows at a time (`_gray`)."""
    count, _ = _channels(g, image)
    return g.cond(g.Equal(count, g.const(1)), [FLOAT], lambda t: [t.Cast(t.Squeeze(image, t.const([2])), to=FLOAT)],
                  lambda t: [by_row_blocks(t, image, height, 3, lambda u, rows: _gray(u, u.Cast(rows, to=FLOAT)), FLOAT)])[0]


def _gray(g: GraphBuilder, pixels: str) -> str:
    """float32 [h, w, channels] -> gray levels [h, w] as Pillow's convert("L") rounds them,
    after any alpha is composited over white (a gray image is its own gray levels)."""
    count, _ = _channels(g, pixels)
    colour = _colour(g, pixels)

    def from_rgb(t: GraphBuilder) -> list[str]:
        weights = t.const(np.array([[19595.0], [38470.0], [7471.0]], dtype=np.float32))
        total = t.Squeeze(t.MatMul(colour, weights), t.const([2]))  # whole numbers below 2^24: exact in float32
        return [t.Floor(t.Div(t.Add(total, t.const(32768.0)), t.const(65536.0)))]

    first = lambda t: [t.Squeeze(t.Slice(colour, t.const([0]), t.const([1]), t.const([2])), t.const([2]))]  # noqa: E731
    return g.cond(g.GreaterOrEqual(count, g.const(3)), [FLOAT], from_rgb, first)[0]


def _normalized(g: GraphBuilder, planes: str, config: ViTConfig) -> str:
    """preprocess.normalize of [C, H, W] gray levels."""
    images = g.Div(planes, g.const(255.0))
    if config.pixel_norm == "image":  # each image's own mean and spread in doubles, as preprocess._image_stats
        wide = g.Cast(images, to=DOUBLE)
        mean = g.ReduceMean(wide, g.const([1, 2]), keepdims=1)
        spread = g.ReduceMean(g.Mul(g.Sub(wide, mean), g.Sub(wide, mean)), g.const([1, 2]), keepdims=1)
        mean, std = g.Cast(mean, to=FLOAT), g.Max(g.Cast(g.Sqrt(spread), to=FLOAT), g.const(MIN_STD))
        return g.Div(g.Sub(images, mean), std)
    mean = g.const(np.asarray(config.mean, dtype=np.float32).reshape(-1, 1, 1))
    std = g.const(np.asarray(config.std, dtype=np.float32).reshape(-1, 1, 1))
    return g.Div(g.Sub(images, mean), std)


def write_pipeline(logits_graph: Path, target: Path, config: ViTConfig) -> Path:
    """preprocessing_graph + the logits graph at `logits_graph` + `pipeline_answers` -> `target`."""
    network = onnx.load(str(logits_graph))
    preprocessing = onnx.compose.add_prefix(preprocessing_graph(config), "preprocess/")
    network, preprocessing = _same_opset(network, preprocessing)
    merged = onnx.compose.merge_models(preprocessing, network, io_map=[(preprocessing.graph.output[0].name, GRAPH_INPUT)],
                                       outputs=[GRAPH_LOGITS], prefix2="")
    merged.graph.node.extend(pipeline_answers(config).nodes)
    del merged.graph.output[:]
    merged.graph.output.append(helper.make_tensor_value_info(PIPELINE_OUTPUT, FLOAT, [config.num_classes]))
    return save_with_image_input(merged, target)


def pipeline_answers(config: ViTConfig) -> GraphBuilder:
    """The nodes after the network in pipeline.onnx: its logits -> `probabilities`."""
    g = GraphBuilder()
    g.nodes.append(helper.make_node("Identity", [probabilities(g, GRAPH_LOGITS, config)], [PIPELINE_OUTPUT],
                                    name=PIPELINE_OUTPUT))
    return g


def probabilities(g: GraphBuilder, logits: str, config: ViTConfig) -> str:
    """logits [1, classes] -> probabilities [classes], softmax at the config's temperature (as
    postprocess.softmax)."""
    return g.Squeeze(g.Softmax(g.Div(logits, g.const(np.float32(config.temperature))), axis=-1), g.const([0]))


def _same_opset(network: onnx.ModelProto, preprocessing: onnx.ModelProto) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """Both graphs at the higher of their opsets (the preprocessing needs at least OPSET), and
    the network's IR version, so they can be merged."""
    opsets = [_opset(model) for model in (network, preprocessing)]
    network, preprocessing = (model if opset == max(opsets) else onnx.version_converter.convert_version(model, max(opsets))
                              for model, opset in zip((network, preprocessing), opsets))
    preprocessing.ir_version = network.ir_version = max(network.ir_version, preprocessing.ir_version)
    return network, preprocessing


def _opset(model: onnx.ModelProto) -> int:
    return next(entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx"))


def save_with_image_input(merged: onnx.ModelProto, target: Path) -> Path:
    """The decoder's `image` as the merged graph's one input (the preprocessing's, renamed),
    then the graph checked and saved to `target`."""
    del merged.graph.input[:]
    merged.graph.input.append(helper.make_tensor_value_info(PIPELINE_INPUT, UINT8, ["height", "width", "channels"]))
    _rename_input(merged, f"preprocess/{PIPELINE_INPUT}", PIPELINE_INPUT)
    onnx.checker.check_model(merged)
    onnx.save(merged, str(target))
    return target


def _rename_input(model: onnx.ModelProto, old: str, new: str) -> None:
    for node in model.graph.node:
        node.input[:] = [new if name == old else name for name in node.input]


# Decoded pixels, and the check against the Python path ----------------------------------------
def decoded_pixels(image: Image.Image) -> np.ndarray:
    """A PIL image -> uint8 [height, width, channels] as a decoder hands it to an app: gray,
    gray + alpha, RGB or RGBA (palettes expanded, 16-bit scaled to 8 bits, CMYK as RGB)."""
    if image.mode not in ("L", "LA", "RGB", "RGBA"):
        with_alpha = "A" in image.getbands() or "transparency" in image.info
        image = to_model_mode(image, 1) if image.mode.startswith("I") or image.mode == "F" else \
            image.convert("RGBA" if with_alpha else "RGB")
    pixels = np.asarray(image)
    return pixels[..., None] if pixels.ndim == 2 else pixels


def pipeline_session(path: Path) -> ort.InferenceSession:
    """A CPU session of a pipeline graph this export just wrote."""
    return ort.InferenceSession(str(path), quiet_session_options(), providers=["CPUExecutionProvider"])


def run_pipeline(session: ort.InferenceSession, pixels: np.ndarray) -> np.ndarray:
    """uint8 [height, width, channels] -> probabilities float32 [classes]."""
    return session.run([PIPELINE_OUTPUT], {PIPELINE_INPUT: pixels}, QUIET_RUN)[0]


def verification_uploads(images: list[Image.Image], config: ViTConfig) -> list[tuple[str, Image.Image]]:
    """Real images turned into what people upload, (name, image): each as it is, as a photo of
    paper (dark ink on light, uneven light, enlarged), as a screenshot-sized transparent canvas
    with a thin pen, and with an alpha channel (gray + alpha, or RGBA)."""
    rng = np.random.default_rng(0)
    uploads = []
    for number, image in enumerate(images):
        gray = np.asarray(to_model_mode(image, 1), dtype=np.float32)
        uploads.append((f"image {number}", image))
        uploads.append((f"image {number} photographed", _photographed(image, gray, rng, config)))
        uploads.append((f"image {number} on a canvas", _on_canvas(gray, rng)))
        alpha = Image.fromarray((rng.uniform(0.6, 1.0, gray.shape) * 255).astype(np.uint8))
        with_alpha = image.convert("LA" if image.mode == "L" else "RGBA")
        with_alpha.putalpha(alpha)
        uploads.append((f"image {number} with alpha", with_alpha))
    return uploads


def _photographed(image: Image.Image, gray: np.ndarray, rng: np.random.Generator, config: ViTConfig) -> Image.Image:
    """Enlarged 4-12x (to 4 megapixels at most), lit unevenly, with sensor noise; a digit's ink
    dark on light paper."""
    scale = min(rng.uniform(4, 12), (PHOTO_PIXELS / (image.width * image.height)) ** 0.5)
    size = (max(2, round(image.width * scale)), max(2, round(image.height * scale)))
    base = 255.0 - gray if config.canonicalize == "digit" else gray
    colour = np.asarray(image.convert("RGB"), dtype=np.float32) if config.canonicalize != "digit" else base[..., None] * \
        np.array([1.0, 0.97, 0.9], dtype=np.float32)
    big = np.asarray(Image.fromarray(colour.clip(0, 255).astype(np.uint8)).resize(size, Image.Resampling.BICUBIC),
                     dtype=np.float32)
    light = np.linspace(0.75, 1.0, size[0], dtype=np.float32)[None, :, None]
    noisy = big * light + rng.normal(0, 3, big.shape)
    return Image.fromarray(noisy.clip(0, 255).astype(np.uint8))


def _on_canvas(gray: np.ndarray, rng: np.random.Generator) -> Image.Image:
    """The image's ink as a thin dark pen on a transparent 1280x720 canvas, off centre (enlarged
    8-14x, or shrunk to fit)."""
    width, height = CANVAS
    scale = min(rng.uniform(8, 14), 0.9 * width / gray.shape[1], 0.9 * height / gray.shape[0])
    size = (max(2, round(gray.shape[1] * scale)), max(2, round(gray.shape[0] * scale)))
    ink = np.asarray(Image.fromarray(gray.astype(np.uint8)).resize(size, Image.Resampling.BILINEAR)) > 160
    canvas = np.zeros((height, width, 4), dtype=np.uint8)
    top, left = int(rng.integers(0, height - size[1] + 1)), int(rng.integers(0, width - size[0] + 1))
    canvas[top:top + size[1], left:left + size[0]][ink] = (20, 20, 60, 255)
    return Image.fromarray(canvas, "RGBA")


def verify_pipeline(pipeline: Path, logits_graph: Path, config: ViTConfig, uploads: list[tuple[str, Image.Image]],
                    tolerance: float = PROBABILITY_TOLERANCE) -> dict[str, Any]:
    """pipeline.onnx against the Python path (`preprocess`, the logits graph, softmax) on each
    upload: the report's section for it, with a failure for any upload whose top label differs
    (where the Python path's margin exceeds the tolerance), whose probabilities differ by more,
    or that one path refuses (no ink in a digit model) and the other answers."""
    graph, network = pipeline_session(pipeline), pipeline_session(logits_graph)
    rows, failures = [], []
    for name, image in uploads:
        row, failure = _compare(graph, network, image, config, tolerance)
        rows.append({"upload": name, "size": list(image.size), "mode": image.mode, **row})
        if failure:
            failures.append(f"{pipeline.name} on {name}: {failure}")
    return {"uploads": len(rows), "tolerance_max_abs_diff": tolerance, "provider": "CPUExecutionProvider",
            "max_abs_diff": max(row["max_abs_diff"] for row in rows), "rows": rows, "failures": failures}


def _compare(graph: ort.InferenceSession, network: ort.InferenceSession, image: Image.Image, config: ViTConfig,
             tolerance: float) -> tuple[dict[str, Any], str | None]:
    """(a row of the report, what failed or None) for one upload."""
    try:
        pixel_values = preprocess(image, config)[None]
    except canonical.EmptyImageError:
        try:
            run_pipeline(graph, decoded_pixels(image))
        except ORT_ERRORS:
            return {"max_abs_diff": 0.0, "label": None, "same_label": True, "refused": True}, None
        return ({"max_abs_diff": 0.0, "label": None, "same_label": False, "refused": True},
                "expected a refusal (no ink), as the Python path refuses it, got an answer")
    expected = softmax(network.run([GRAPH_LOGITS], {GRAPH_INPUT: pixel_values}, QUIET_RUN)[0], config.temperature)[0]
    got = run_pipeline(graph, decoded_pixels(image))
    difference = float(np.abs(expected - got).max())
    ranked = np.sort(expected)[::-1]
    label_differs = int(got.argmax()) != int(expected.argmax()) and ranked[0] - ranked[1] > tolerance
    row = {"max_abs_diff": difference, "label": config.labels[int(expected.argmax())], "same_label": not label_differs}
    if not label_differs and difference <= tolerance:  # NaN fails
        return row, None
    return row, (f"expected the Python path's probabilities within {tolerance:g} and its label {row['label']!r}, "
                 f"got {config.labels[int(got.argmax())]!r} and a difference of {difference:.2g}")
