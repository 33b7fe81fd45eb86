"""Gradio demo: classify an image with a vit_hub model and show where it looked.

    python app.py                                   # bundled MNIST model, torch backend
    python app.py --model user/repo --backend onnx --port 8000

The page takes an uploaded image (or, for grayscale models, a drawing), shows the top-k
classes, a map of how much each patch supports the predicted class (the method is a
control: vit_hub.attribution.METHODS; the page opens with the one measured most faithful on
the model, see QUICK_METHODS) and the attention rollout layer by layer. The same function is
served as the named API endpoint `/predict` (and `/predict_drawing`) for gradio_client;
`/predict_labels` (image, top-k) gives the labels alone, without the four pictures that
gradio_client would download one by one.

Nothing happens at import: `build_demo(predictor)` builds the UI for any backend that
implements `Predictor`, and `main()` parses the flags, loads the model and serves it,
bound to 127.0.0.1 (GRADIO_SERVER_NAME when set) with analytics, share links and
server-side rendering off. In a Space folder written by `vit-hub space`, its space.json
names the model, so `python app.py` starts the Space's app with no flags.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import functools
import math
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import gradio as gr
import numpy as np
from gradio.data_classes import FileData
from gradio.utils import get_upload_folder
from PIL import Image

from vit_hub.console import OneLineErrorParser
from vit_hub.config import ViTConfig
from vit_hub.postprocess import softmax, top_k
from vit_hub.canonical import EmptyImageError, centre_digit
from vit_hub.insight import ModelViews, compute_views, default_data, head_grid, head_maps, load_pixels, pooled_token
from vit_hub.preprocess import (check_header, load_image, model_pixels, open_image, pixel_limit, resize,
                                 to_model_domain, to_model_mode)
from vit_hub.attribution import METHODS, attention_map, blank_pixels, check_method, occlusion
from vit_hub.rollout import HEAD_FUSIONS, layer_rollouts, overlay
from vit_hub.space import SpaceSettings, read_settings

ROOT = Path(__file__).resolve().parent
DEFAULT_MODEL = ROOT / "models" / "vit-mnist"
SAMPLES = ROOT / "samples"

# Overlays have the input's size, except: a longer side under DISPLAY_MIN_SIDE is scaled up
# by the smallest integer factor reaching it (28x28 -> 280x280), one over DISPLAY_MAX_SIDE
# is scaled down to it. Drawings are shown as the model sees them (the centred digit).
DISPLAY_MIN_SIDE = 280
DISPLAY_MAX_SIDE = 1024
STRIP_TILE_HEIGHT = 96  # height of each tile in the per-layer rollout strip
MAX_FILE_SIZE = "20mb"
CONCURRENCY_LIMIT = 4  # requests computed at once; more wait in the queue
# Largest image a request may send (pixels, read from its header before it is decoded): a 12 MP
# phone photo fits. Decoding and converting an RGBA image holds about 15 bytes a pixel (16 MP:
# +244 MB measured), so the requests in flight (CONCURRENCY_LIMIT) hold at most about 1 GB.
APP_MAX_PIXELS = 16_000_000
QUEUE_SIZE = 64
MAX_NAME_CHARS = 80  # of a client's file name, when a message names it
MAX_PORT = 65535
# An absolute path in a message: /dir/.../name or C:\dir\...\name; `name` is its last part.
ABSOLUTE_PATH = re.compile(r"(?:(?<![\w.~])/|\b[A-Za-z]:[\\/])(?:[^\s/\\'\"]+[/\\])*(?P<name>[^\s/\\'\"]*)")
# The map the page opens with: of the methods whose map (forward pass and method) takes at most
# about 15 ms on a 2-core CPU (QUICK_METHODS; BENCHMARKS.md, "Explanation faithfulness"), the one
# measured most faithful on the served model (insertion minus deletion AUC in its
# faithfulness.json); DEFAULT_METHOD for a model never measured, ONNX_DEFAULT_METHOD when the
# backend computes no gradients and nothing was measured.
QUICK_METHODS = tuple(name for name in METHODS if name != "occlusion")  # occlusion's map: 27-63 ms
DEFAULT_METHOD = "integrated_gradients"
ONNX_DEFAULT_METHOD = "rollout"
FAITHFULNESS_FILE = "faithfulness.json"  # in the model dir: written by bench/faithfulness.py --write
# Small inputs (a 28x28 digit) fill the upload box with visible pixels instead of a speck.
CSS = "#upload img { width: 100%; height: 100%; object-fit: contain; image-rendering: pixelated; }"


# Backends -------------------------------------------------------------------------------
class Predictor(Protocol):
    """A backend the UI can drive: the model's config and one forward pass."""

    config: ViTConfig
    description: str  # shown on the page, e.g. "torch (CPU)"
    methods: tuple[str, ...]  # the explanation methods it computes (names in vit_hub.attribution.METHODS)
    model_dir: Path | None  # where the model's files are, when they are in a local folder

    def predict(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 [B, C, H, W] -> (probabilities [B, classes], attentions [depth, B, heads, T, T])."""

    def explain(self, pixels: np.ndarray, method: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """float32 [B, C, H, W] -> (probabilities, attentions, the method's maps [B, grid_h, grid_w])."""

    def weights(self) -> dict[str, np.ndarray] | None:
        """The model's weights as arrays (for the "Inside the model" tab), None when it has none."""


class TorchPredictor:
    """The PyTorch model, on the CPU.

    threads: torch intra-op threads for the whole process. One per request is best for a
    small model: concurrent requests already keep the cores busy, and several threads
    per forward pass spin against each other (measured 10x slower on a loaded 2-core
    machine; see BENCHMARKS.md).
    """

    def __init__(self, model: Any, threads: int | None = 1):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.model = model.eval()
        self.config = model.config
        self.description = "torch (CPU)"
        self.methods = tuple(METHODS)
        self.model_dir: Path | None = None

    @classmethod
    def load(cls, reference: str | Path, threads: int | None = 1, revision: str | None = None) -> "TorchPredictor":
        from vit_hub.pretrained import load_model

        predictor = cls(load_model(reference, revision), threads)
        predictor.model_dir = Path(reference) if Path(reference).is_dir() else None
        return predictor

    def predict(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import torch

        with torch.inference_mode():
            logits, attentions = self.model(torch.from_numpy(pixels), output_attentions=True)
        return softmax(logits.numpy()), torch.stack(attentions).numpy()

    def explain(self, pixels: np.ndarray, method: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        from vit_hub.explain import explain

        logits, attentions, maps = explain(self.model, pixels, method)
        return softmax(logits), attentions, maps

    def weights(self) -> dict[str, np.ndarray]:
        from vit_hub.insight import torch_weights

        return torch_weights(self.model)


class OnnxPredictor:
    """ONNX Runtime on the model's `model_attentions.onnx` graph (torch-free at run time)."""

    def __init__(self, classifier: Any):
        if not classifier.can_output_attentions:
            raise ValueError(f"{classifier.model_path} has no attentions graph; export with --output-attentions")
        self.classifier = classifier
        self.config = classifier.config
        self.methods = tuple(name for name, method in METHODS.items() if method.needs != "gradients")
        self.model_dir = classifier.model_dir
        self.description = f"ONNX Runtime ({classifier.providers[0]}, {classifier.precision})"
        # One run now: a graph that cannot load fails at start, not at a user's first request.
        self.predict(np.zeros((1, self.config.in_channels, *self.config.image_size), dtype=np.float32))

    @classmethod
    def load(cls, reference: str | Path, threads: int | None = 1, revision: str | None = None) -> "OnnxPredictor":
        """A model dir or Hub repo id (at `revision`); without model_attentions.onnx there, export
        to a temp dir first. threads: onnxruntime intra-op threads per session (one, as for torch)."""
        from export import OnnxClassifier

        return cls(OnnxClassifier.from_model(reference, output_attentions=True, export_dir=_export_dir,
                                             threads=threads, revision=revision))

    def predict(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits, attentions = self.classifier.run(pixels, output_attentions=True)
        return softmax(logits), attentions

    def explain(self, pixels: np.ndarray, method: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The maps that need no gradients: from the attentions, or occlusion from the logits graph."""
        if check_method(method).needs == "gradients":
            raise ValueError(f"{METHODS[method].label} needs gradients, which the ONNX backend does not compute: "
                             f"start the app with --backend torch, or choose one of "
                             f"{', '.join(METHODS[name].label for name in self.methods)}")
        probabilities, attentions = self.predict(pixels)
        if method == "occlusion":
            config = self.config
            maps = occlusion(self.classifier.run, pixels, probabilities.argmax(-1), config.grid_size,
                             tuple(config.patch_size), blank_pixels(config))
        else:
            maps = attention_map(method, attentions, self.config)
        return probabilities, attentions, maps

    def weights(self) -> dict[str, np.ndarray] | None:
        """model.safetensors read as arrays (no torch) when the model dir has it; else None."""
        from vit_hub.insight import read_weights

        folder = self.classifier.model_dir
        return read_weights(folder) if (folder / "model.safetensors").is_file() else None


def _export_dir(model_dir: Path) -> Path:
    """A temporary folder for the ONNX export of a model that ships none, removed at exit."""
    out = Path(tempfile.mkdtemp(prefix="vit_hub_onnx_"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)  # also on SIGTERM: see main()
    print(f"app.py: {model_dir} has no model_attentions.onnx; exporting to {out} (torch is loaded for this; "
          f"`python -m export --output-attentions` once makes later starts torch-free) ...", flush=True)
    return out


# Reading inputs -------------------------------------------------------------------------
def read_upload(upload: dict | str | None) -> Image.Image:
    """A file this client uploaded (Gradio's file data) -> decoded PIL image, upright.

    Anything unusable raises gr.Error naming the client's own file name, never a server
    path. The size is checked from the header before decoding (`open_image`), so a huge
    image is refused without spending memory on it.
    """
    path, name = uploaded_file(upload)
    try:
        return load_image(open_image(path, name, APP_MAX_PIXELS))
    except (OSError, ValueError) as error:
        raise gr.Error(without_paths(str(error))) from None


def uploaded_file(upload: dict | str | None) -> tuple[Path, str]:
    """(the upload's path on the server, the name its client gave it), for uploads only.

    /predict takes its file data unprocessed, and Gradio checks paths only in file data
    that carries its `meta` marker, so the path a request names is checked here: with
    symlinks and `..` resolved, it must lie inside Gradio's upload folder, where every
    upload (and every bundled example shown on the page) is copied. Anything else, a
    file elsewhere on the server or a URL, is refused without being opened.
    """
    path, name = (upload.get("path"), upload.get("orig_name")) if isinstance(upload, dict) else (upload, None)
    if not path:
        raise gr.Error("No image yet: upload one or pick an example.")
    try:
        resolved = Path(path).resolve()
        inside = isinstance(path, str) and resolved.is_relative_to(Path(get_upload_folder()).resolve())
    except (OSError, ValueError, TypeError):  # a null byte, a symlink loop, not a string
        inside = False
    if not inside:
        raise gr.Error("Only images uploaded to this app can be classified: expected an uploaded file, "
                       "got a path that is not an upload.")
    return resolved, client_name(name if isinstance(name, str) and name else str(path))


def client_name(name: str) -> str:
    """The last part of a client's file name (either kind of slash), shortened for messages."""
    base = re.split(r"[\\/]", name)[-1] or "the image"
    return base if len(base) <= MAX_NAME_CHARS else base[:MAX_NAME_CHARS - 3] + "..."


def checked_sketchpad(**options: Any) -> gr.Sketchpad:
    """gr.Sketchpad whose images (composite, layers, background: files or the blobs the page
    sends) are checked against APP_MAX_PIXELS from their headers before Gradio decodes them.
    The check wraps the instance's decoding rather than subclassing: Gradio writes a .pyi stub
    beside the module of every component subclass, and the app writes nowhere but its temp
    and upload folders (a Space's folder stays as it was pushed)."""
    sketchpad = gr.Sketchpad(**options)
    decode = sketchpad.convert_and_format_image

    def checked_decode(file: FileData | bytes | None, flatten_on_white: bool = False):
        if file is not None:
            try:
                check_header(file.path if isinstance(file, FileData) else bytes(file), "the drawing", APP_MAX_PIXELS)
            except ValueError as error:
                raise gr.Error(without_paths(str(error))) from None
        return decode(file, flatten_on_white)

    sketchpad.convert_and_format_image = checked_decode
    return sketchpad


def read_drawing(value: dict | None, size: tuple[int, int]) -> Image.Image:
    """The sketchpad's value -> the centred digit the model will see.

    Gradio preprocesses it (only files uploaded to this app get through, each checked from
    its header by `Sketchpad`) into PIL images; anything else, such as a path, is refused
    here rather than opened.
    """
    composite = (value or {}).get("composite")
    if composite is None:
        raise gr.Error("The drawing is empty: draw a digit first.")
    if not isinstance(composite, Image.Image):
        raise gr.Error(f"expected the drawing as an image, got {type(composite).__name__}")
    try:
        return centre_digit(to_model_mode(load_image(composite), 1), size)
    except EmptyImageError:
        raise gr.Error("The drawing is empty: draw a digit first.") from None


# Explaining -----------------------------------------------------------------------------
@dataclass
class Explanation:
    scores: dict[str, float]  # top-k label -> probability
    overlay: Image.Image  # the chosen method's map over the display image
    strip: Image.Image  # rollout after each layer, left to right
    model_input: Image.Image  # the input as the model saw it (canonicalised, resized), enlarged
    heads: Image.Image  # each head's attention from the pooled token: a row per layer, a column per head


def display_size(width: int, height: int) -> tuple[int, int]:
    """The (width, height) an overlay is drawn at for an input of that size."""
    longer = max(width, height)
    if longer < DISPLAY_MIN_SIDE:
        factor = math.ceil(DISPLAY_MIN_SIDE / longer)
        return width * factor, height * factor
    if longer > DISPLAY_MAX_SIDE:
        scale = DISPLAY_MAX_SIDE / longer
        return max(1, round(width * scale)), max(1, round(height * scale))
    return width, height


def for_display(image: Image.Image) -> Image.Image:
    """The image at its display size; small images keep sharp pixels."""
    size = display_size(*image.size)
    if size == image.size:
        return image
    upscaling = size[0] > image.width
    return image.resize(size, Image.Resampling.NEAREST if upscaling else Image.Resampling.BILINEAR)


def layer_strip(view: Image.Image, maps: np.ndarray) -> Image.Image:
    """One tile per layer: maps [depth, grid_h, grid_w] over the model's view, side by side."""
    width = max(1, round(view.width * STRIP_TILE_HEIGHT / view.height))
    tile_base = view.resize((width, STRIP_TILE_HEIGHT), Image.Resampling.NEAREST)
    gap = 4
    strip = Image.new("RGB", (len(maps) * (width + gap) - gap, STRIP_TILE_HEIGHT), "white")
    for index, layer_map in enumerate(maps):
        strip.paste(overlay(tile_base, layer_map), (index * (width + gap), 0))
    return strip


def explain(predictor: Predictor, view: Image.Image, head_fusion: str, discard_ratio: float,
            k: int, method: str = "rollout") -> Explanation:
    """Classify `view` (already in the model's domain: `to_model_domain`) and draw the
    method's map over it, at its display size. Rollout uses head_fusion and discard_ratio;
    the per-layer strip is always rollout."""
    config = predictor.config
    pixels = model_pixels(view, config)[None]  # [1, C, H, W]
    if check_method(method) is METHODS["rollout"]:  # with the head fusion and discard ratio chosen
        probabilities, attentions = predictor.predict(pixels)
        chosen = None
    else:
        probabilities, attentions, chosen = predictor.explain(pixels, method)
    maps = layer_rollouts(attentions, head_fusion, float(discard_ratio), config.grid_size,
                          config.pooling)[:, 0]  # [depth, h, w]
    scores = dict(top_k(probabilities, config.labels, int(k))[0])
    model_view = resize(view, config)
    heads = head_grid(model_view, head_maps(attentions, config)[:, 0])  # [depth, heads, h, w] maps
    shown = maps[-1] if chosen is None else chosen[0]
    return Explanation(scores, overlay(for_display(view), shown), layer_strip(model_view, maps),
                       for_display(model_view), heads)


def measured_faithfulness(model_dir: Path | None) -> dict | None:
    """The model's faithfulness.json (bench/faithfulness.py --write), None when it has none or
    one the page cannot use (not JSON, an AUC that is not a number): a warning says why, and the
    page opens with the default method."""
    path = model_dir / FAITHFULNESS_FILE if model_dir else None
    if path is None or not path.is_file():
        return None
    import warnings

    from vit_hub.config import read_json

    try:
        measured = read_json(path)
        rows = measured.get("methods") if isinstance(measured, dict) else None
        if not isinstance(rows, dict) or "images" not in measured:
            raise ValueError(f"expected an object with images and methods, found {str(measured)[:80]}")
        for name, row in rows.items():
            aucs = [row.get(key) for key in ("deletion_auc", "insertion_auc")] if isinstance(row, dict) else [None]
            if not all(isinstance(auc, (int, float)) and math.isfinite(auc) for auc in aucs):
                raise ValueError(f"expected numbers for {name}'s deletion_auc and insertion_auc, found {str(row)[:80]}")
    except ValueError as error:
        warnings.warn(f"{FAITHFULNESS_FILE} not used, the page opens with the default method: {error}", stacklevel=2)
        return None
    return measured


def opening_method(predictor: Predictor) -> str:
    """The method the page opens with (see QUICK_METHODS)."""
    measured = measured_faithfulness(predictor.model_dir)
    rows = measured["methods"] if measured else {}
    candidates = [name for name in QUICK_METHODS if name in predictor.methods and name in rows]
    if candidates:
        return max(candidates, key=lambda name: rows[name]["insertion_auc"] - rows[name]["deletion_auc"])
    return DEFAULT_METHOD if DEFAULT_METHOD in predictor.methods else ONNX_DEFAULT_METHOD


def faithfulness_table(model_dir: Path | None, methods: tuple[str, ...]) -> str:
    """Markdown: each method's deletion and insertion AUC as bench/faithfulness.py measured them
    on this model (its faithfulness.json), a row per method, or where to find that out."""
    measured = measured_faithfulness(model_dir)
    if measured is None:
        return ("How faithful each method is was not measured for this model (`bench/faithfulness.py --write "
                f"MODEL_DIR/{FAITHFULNESS_FILE}`); BENCHMARKS.md has the bundled model's figures.")
    rows = measured["methods"]
    named = [(METHODS[name].label, rows[name]) for name in methods if name in rows]
    named += [(name.split(" (")[0].split(":")[0], row) for name, row in rows.items() if name not in METHODS]
    table = "\n".join(f"| {label} | {row['deletion_auc']:.3f} | {row['insertion_auc']:.3f} |" for label, row in named)
    return (f"Measured on {measured['images']} test images by `bench/faithfulness.py`: blank the patches a map "
            f"ranks first and see how fast the predicted class's probability falls (deletion AUC, lower is "
            f"better), or restore them first and see how fast it comes back (insertion AUC, higher is better).\n\n"
            f"| method | deletion AUC | insertion AUC |\n|---|---|---|\n{table}")


def _user_errors(handler: Callable) -> Callable:
    """Report bad input (ValueError/TypeError from preprocessing or rollout) as gr.Error,
    with any server path in the message cut to its last part; give the memory the request
    freed back to the system afterwards."""
    @functools.wraps(handler)
    def wrapped(*args):
        try:
            return handler(*args)
        except gr.Error:
            raise
        except (ValueError, TypeError) as error:
            raise gr.Error(without_paths(str(error))) from None
        finally:
            return_freed_memory()
    return wrapped


# glibc keeps the large blocks a request freed (a decoded image) for reuse in its per-thread
# arenas: after a burst of large uploads the server held 500 MB more than before it.
# malloc_trim(0) returns them; other C libraries have no such call and need none.
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform.startswith("linux") else None


def return_freed_memory() -> None:
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def without_paths(message: str) -> str:
    """Absolute paths (POSIX or Windows) in a message -> their last part, e.g. /tmp/a/x.png -> x.png."""
    return ABSOLUTE_PATH.sub(lambda match: match.group("name"), message)


# The UI ---------------------------------------------------------------------------------
def build_demo(predictor: Predictor) -> gr.Blocks:
    """The Gradio app for one predictor. Launch it with `serve(demo, ...)`."""
    config = predictor.config
    config.check_has_head("the app")

    default_method = opening_method(predictor)

    @_user_errors
    def predict(image: dict | None, head_fusion: str, discard_ratio: float, k: int,
                method: str = default_method):
        """Top-k labels, the method's overlay (at display_size of the input, or of the canonical
        input when the config canonicalises), the per-layer rollout strip, the model's input and
        the per-head maps. Callers that read only the labels: /predict_labels (no pictures), or
        gradio_client's Client(..., download_files=False) to fetch only the pictures wanted."""
        view = to_model_domain(read_upload(image), config)
        result = explain(predictor, view, head_fusion, discard_ratio, k, method)
        return result.scores, result.overlay, result.strip, result.model_input, result.heads

    @_user_errors
    def predict_labels(image: dict | None, k: int = 3) -> dict[str, float]:
        """The top-k labels only: no map and no pictures, for API callers that read nothing else
        (through gradio_client each picture of /predict is one more download)."""
        view = to_model_domain(read_upload(image), config)
        probabilities, _ = predictor.predict(model_pixels(view, config)[None])
        return dict(top_k(probabilities, config.labels, int(k))[0])

    @_user_errors
    def predict_drawing(drawing: dict | None, head_fusion: str, discard_ratio: float, k: int,
                        method: str = default_method):
        """Like predict, for a drawing; the overlay shows the centred digit the model saw."""
        digit = read_drawing(drawing, config.image_size)
        result = explain(predictor, digit, head_fusion, discard_ratio, k, method)
        return result.scores, result.overlay, result.strip, result.model_input, result.heads

    with gr.Blocks(title="vit_hub: what the ViT looks at", analytics_enabled=False,
                   delete_cache=(600, 3600)) as demo:
        drawn = " or draw a digit" if config.in_channels == 1 else ""
        gr.Markdown(f"## vit_hub: what the Vision Transformer looks at\nUpload an image{drawn}: the model names "
                    f"what it sees, and the map shows which patches made it say so.")
        with gr.Accordion("How faithful is this map?", open=False):
            gr.Markdown(
                f"The map opens with **{METHODS[default_method].label}**: {METHODS[default_method].meaning}; "
                f"Explanation changes the method. The model: {config.num_classes} classes, "
                f"{config.image_size[0]}x{config.image_size[1]} input, {config.depth} layers, on "
                f"{predictor.description}.\n\n{faithfulness_table(predictor.model_dir, predictor.methods)}"
                + ("" if len(predictor.methods) == len(METHODS) else
                   "\n\nThe methods that need gradients are offered with `--backend torch` only.")
            )
        views = _views_or_error(predictor)  # computed once, at start-up
        with gr.Tabs():
            with gr.Tab("Classify"):
                with gr.Row():
                    with gr.Column():
                        with gr.Tabs():
                            with gr.Tab("Upload"):
                                image = gr.Image(type="filepath", label="Image", sources=["upload", "clipboard"],
                                                 height=320, elem_id="upload")
                                submit = gr.Button("Classify", variant="primary")
                                gr.Markdown(f"Images of {pixel_limit(APP_MAX_PIXELS)}, files of at most {MAX_FILE_SIZE}.",
                                            elem_id="upload-limits")
                                if config.in_channels == 1:  # the bundled samples are MNIST digits
                                    _examples(image)
                            if config.in_channels == 1:
                                with gr.Tab("Draw"):
                                    drawing = checked_sketchpad(
                                        type="pil", image_mode="RGB", canvas_size=(400, 400), layers=False,
                                        label="Draw a digit (pick the brush on the left first)", elem_id="drawing",
                                        brush=gr.Brush(default_size=14, colors=["#000000"], color_mode="fixed"),
                                    )
                                    submit_drawing = gr.Button("Classify drawing", variant="primary")
                        method = gr.Dropdown([(METHODS[name].label, name) for name in predictor.methods],
                                             value=default_method, label="Explanation", elem_id="method",
                                             info="what the overlay shows; the strip below it is always rollout")
                        head_fusion = gr.Radio(list(HEAD_FUSIONS), value="mean", label="Head fusion")
                        discard_ratio = gr.Slider(0.0, 0.95, value=0.0, step=0.05, label="Discard ratio",
                                                  info="share of the weakest attention weights dropped per layer")
                        k = gr.Slider(1, config.num_classes, value=min(3, config.num_classes), step=1, label="Top-k")
                    with gr.Column():
                        label = gr.Label(label="Prediction")
                        # JPEG: encodes in 0.2 ms where PNG takes 15 ms (280x280), no visible loss on a heat map.
                        rollout = gr.Image(label="Explanation", type="pil", format="jpeg", interactive=False,
                                           buttons=["download", "fullscreen"], elem_id="rollout")
                        strip = gr.Image(label="Rollout after layer 1, 2, ... (left to right)", type="pil",
                                         format="jpeg", interactive=False, buttons=["download", "fullscreen"],
                                         elem_id="layer-strip")
                        model_input = gr.Image(label=_model_input_label(config), type="pil", format="png",
                                               interactive=False, height=160, elem_id="model-input")
                        heads = gr.Image(label=f"Each head's attention from the {pooled_token(config)}: a row per "
                                         f"layer (layer 1 at the top), a column per head", type="pil", format="jpeg",
                                         interactive=False, buttons=["download", "fullscreen"], height=420,
                                         elem_id="head-maps")
            with gr.Tab("Inside the model", elem_id="inside"):
                _inside_tab(views)

        controls, outputs = [head_fusion, discard_ratio, k, method], [label, rollout, strip, model_input, heads]
        # preprocess=False: the handler opens the upload itself, so a non-image gets a clear gr.Error.
        # Gradio then does not check the path, so read_upload does: only uploads are opened.
        submit.click(predict, [image] + controls, outputs, api_name="predict", concurrency_id="model",
                     concurrency_limit=CONCURRENCY_LIMIT, preprocess=False)
        # API only: the button is never shown, its event is the named endpoint /predict_labels.
        gr.Button(visible=False).click(predict_labels, [image, k], label, api_name="predict_labels",
                                       concurrency_id="model", concurrency_limit=CONCURRENCY_LIMIT, preprocess=False)
        if config.in_channels == 1:
            submit_drawing.click(predict_drawing, [drawing] + controls, outputs, api_name="predict_drawing",
                                 concurrency_id="model", concurrency_limit=CONCURRENCY_LIMIT)
    return demo


INSIDE_TITLES = {
    "patch_filters": "Patch-embedding filters: principal components of the patch projection",
    "position_similarity": "Position-embedding similarity: each patch position against every other",
    "attention_distance": "Mean attention distance per head and layer",
}


def model_views(predictor: Predictor) -> ModelViews:
    """Views 1-3 of the served model: from its weights when the backend has them, with attention
    distances measured on the bundled samples when they fit the model (a digit model)."""
    config = predictor.config
    weights = predictor.weights() if hasattr(predictor, "weights") else None
    data = default_data(config)
    pixels, note = None, ("no images to measure on here: the bundled samples fit only a digit model "
                          "(`vit-hub inspect --model MODEL --data IMAGES` measures it)")
    if data is not None:
        pixels, note = load_pixels(data, config)
    return compute_views(config, weights, lambda batch: predictor.predict(batch)[1], pixels, note)


def _views_or_error(predictor: Predictor) -> ModelViews | str:
    try:
        return model_views(predictor)
    except (OSError, ValueError) as error:  # shown on the tab; the classifier still works
        return f"The views could not be computed: {without_paths(str(error))}"


def _inside_tab(views: ModelViews | str) -> None:
    """Views 1-3 of the model, each with its one-sentence reading (or the reason it is missing)."""
    gr.Markdown("What the model learned, as the ViT paper shows it (Dosovitskiy et al. 2020, Figure 7): the "
                "filters its patch projection applies, how alike its position embeddings are, and how far "
                "each head looks. The per-head maps of one image are under the rollout on the Classify tab.")
    if isinstance(views, str):
        gr.Markdown(views)
        return
    images, readings = views.images(), views.readings()
    for name, title in INSIDE_TITLES.items():  # three views
        gr.Image(images[name], label=title, type="pil", format="png", interactive=False, show_label=True,
                 buttons=["download", "fullscreen"], elem_id=f"inside-{name.replace('_', '-')}")
        gr.Markdown(readings[name])


def _model_input_label(config: ViTConfig) -> str:
    size = f"{config.image_size[0]}x{config.image_size[1]}"
    if config.canonicalize == "digit":
        return f"What the model saw: the digit cropped, centred and scaled like MNIST ({size})"
    return f"What the model saw ({size})"


def _examples(image: gr.Image) -> None:
    paths = sorted(SAMPLES.glob("*.png"))
    if paths:
        gr.Examples([[str(path)] for path in paths], inputs=[image], label="Bundled samples",
                    examples_per_page=len(paths))


def serve(demo: gr.Blocks, host: str = "127.0.0.1", port: int | None = None, **launch: Any):
    """Queue and launch with the safe defaults: no share link, no SSR, capped uploads."""
    demo.queue(max_size=QUEUE_SIZE, default_concurrency_limit=CONCURRENCY_LIMIT)
    return demo.launch(server_name=host, server_port=port, share=False, ssr_mode=False,
                       max_file_size=MAX_FILE_SIZE, css=CSS, **launch)


# Command line ---------------------------------------------------------------------------
def load_predictor(reference: str | Path, backend: str, revision: str | None = None) -> Predictor:
    """revision: of a Hub repo id (branch, tag or commit; default main)."""
    if backend == "torch":
        return TorchPredictor.load(reference, revision=revision)
    if backend == "onnx":
        return OnnxPredictor.load(reference, revision=revision)
    raise ValueError(f"--backend: expected torch or onnx, got {backend!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; in a Space folder (`vit-hub space` wrote space.json beside app.py) the model,
    revision and backend default to the Space's, and a Space's GRADIO_SERVER_NAME and
    GRADIO_SERVER_PORT give the address, so `python app.py` needs no flags there."""
    try:
        space = read_settings(ROOT)
    except (OSError, ValueError) as error:
        raise SystemExit(f"app.py: {error}") from None
    return build_parser(space).parse_args(argv)


def build_parser(space: SpaceSettings | None) -> argparse.ArgumentParser:
    """app.py's flags, their defaults from `space` (a Space folder's space.json) when given."""
    parser = OneLineErrorParser(prog="app.py", description=(
        "Serve a vit_hub model in a Gradio page: upload or draw an image, see the top classes and a map of "
        "the patches that made the model say so. Also an HTTP API (/predict, /predict_labels)."))
    parser.add_argument("--model", default=space.model if space else str(DEFAULT_MODEL),
                        help="model dir or Hugging Face Hub repo id (default: %(default)s)")
    parser.add_argument("--revision", default=space.revision if space else None,
                        help="branch, tag or commit of a Hub repo id (default: the Space's pinned commit in a "
                             "Space folder, else main)")
    parser.add_argument("--backend", choices=("torch", "onnx"), default=space.backend if space else "torch",
                        help="torch computes every explanation method; onnx runs ONNX Runtime without torch on "
                             "the model's model_attentions.onnx (exported to a temporary folder first when it has "
                             "none) and offers the methods that need no gradients (default: %(default)s)")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME") or "127.0.0.1",
                        help="address to listen on; 0.0.0.0 opens the app to the network (default: "
                             "GRADIO_SERVER_NAME, else 127.0.0.1, this machine only; now %(default)s)")
    parser.add_argument("--port", type=_port, default=os.environ.get("GRADIO_SERVER_PORT") or "7860",
                        help="port to listen on (default: GRADIO_SERVER_PORT, else 7860; now %(default)s)")
    return parser


def _port(text: str) -> int:
    if not (text.isdigit() and 1 <= int(text) <= MAX_PORT):
        raise argparse.ArgumentTypeError(f"expected a port number from 1 to {MAX_PORT}, got {text!r}")
    return int(text)


def check_can_listen(host: str, port: int) -> None:
    """Bind once, before the model loads: Gradio reports every bind failure (port taken, no
    such address) as "Cannot find empty port", with a traceback."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as error:
        raise SystemExit(f"app.py: --host {host} --port {port}: expected an address and port this machine can "
                         f"listen on, got {error.strerror or error}") from None


_sigterm_received = False


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (a service manager, `kill`) exits like Ctrl-C does, so exit handlers run and
    a temporary export folder is removed. A second SIGTERM during that shutdown (`kill` of
    the whole process group reaches the app twice through make) returns here and is
    dropped: the handler stays installed, because swapping in SIG_IGN while a signal is
    pending makes Python print a "race condition" traceback."""
    global _sigterm_received
    if _sigterm_received:
        return
    _sigterm_received = True
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_can_listen(args.host, args.port)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        predictor = load_predictor(args.model, args.backend, args.revision)
        predictor.config.check_has_head("the app")
    except (OSError, ValueError) as error:
        raise SystemExit(f"app.py: cannot load --model {args.model}: {error}") from None
    # Gradio's own start-up lines include a hint to set share=True; this app never shares.
    print(f"app.py: serving {args.model} ({predictor.description}) at http://{args.host}:{args.port} "
          f"(no share link, no analytics; Ctrl-C stops)", flush=True)
    try:
        serve(build_demo(predictor), args.host, args.port, quiet=True)
    except OSError as error:  # taken since check_can_listen
        raise SystemExit(f"app.py: --host {args.host} --port {args.port}: expected an address and port this "
                         f"machine can listen on, got {error}") from None


if __name__ == "__main__":
    main()
