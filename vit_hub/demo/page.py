"""The Gradio page and its named API endpoints, for any backend that implements `Predictor`.

The Classify tab takes an upload (or, for a digit model, a drawing) and shows the top-k
classes, the chosen method's map over the image, rollout after each layer, the model's input
and each head's attention; the Inside tab shows what the model learned. The endpoints, for
gradio_client or plain HTTP:

    /predict          (image, head fusion, discard ratio, top-k, method) -> top-k labels and the
                      method's map as numbers: nothing for a client to download
    /predict_labels   (image, top-k) -> the top-k labels alone, the quickest answer
    /explain          /predict's inputs -> the labels and the page's four pictures, each one a
                      file that gradio_client downloads
    /explain_drawing  like /explain, for the sketchpad's drawing

Nothing happens at import: `build_demo(predictor)` builds the Blocks, `serve(demo)` launches
them with the safe defaults.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
from PIL import Image

from vit_hub.data.samples import example_images, is_digit_model
from vit_hub.demo.backends import Predictor
from vit_hub.demo.methods import faithfulness_table, opening_method
from vit_hub.demo.pictures import answer, explain, map_values
from vit_hub.demo.uploads import (APP_MAX_PIXELS, MAX_FILE_SIZE, checked_sketchpad, map_large_blocks,
                                  message_gradio_refusals, read_drawing, read_upload, user_errors, without_paths)
from vit_hub.errors import UserError
from vit_hub.explain.attribution import METHODS
from vit_hub.explain.rollout import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, HEAD_FUSIONS
from vit_hub.insight.figures import view_images
from vit_hub.insight.inspect import default_data, load_pixels
from vit_hub.insight.views import ModelViews, compute_views, pooled_token
from vit_hub.model.config import ViTConfig, size_text
from vit_hub.processing.postprocess import top_k
from vit_hub.processing.preprocess import decode_side, model_pixels, pixel_limit, to_model_domain

CONCURRENCY_LIMIT = 4  # requests computed at once; more wait in the queue
QUEUE_SIZE = 64
# Gradio keeps a copy of the page's config for every session, about 80 KB each, and each API
# call without a session is a new one: at Gradio's default of 10,000 a server grew 20 MB every
# 250 requests. The page keeps no state in a session, so the oldest are dropped sooner.
SESSIONS_KEPT = 256
# zlib's quickest level for the overlay's PNG: it encodes in a quarter of the default level's time
# for a file a quarter larger (BENCHMARKS.md, "Time in the handler").
OVERLAY_PNG_LEVEL = 1
MAX_LABELS_NAMED = 5  # the header names a model's first classes, then says how many more
# Small inputs (a 28x28 digit) fill the upload box with visible pixels instead of a speck; the
# answer's pictures start below the label that floats over their top edge (it hid the head
# grid's first row).
CSS = ("#upload img { width: 100%; height: 100%; object-fit: contain; image-rendering: pixelated; }\n"
       "#layer-strip img, #model-input img, #head-maps img { padding-top: 2.2em; box-sizing: border-box; }")
INSIDE_TITLES = {
    "patch_filters": "Patch-embedding filters: principal components of the patch projection",
    "position_similarity": "Position-embedding similarity: each patch position against every other",
    "attention_distance": "Mean attention distance per head and layer",
}


@dataclass
class Handlers:
    """What each endpoint computes, for one predictor. Every input is untrusted: the image is
    opened only when it is an upload (read_upload), the controls are checked (`controls`)."""

    predictor: Predictor
    default_method: str

    def controls(self, head_fusion: Any, discard_ratio: Any, k: Any) -> tuple[str, float, int]:
        """The controls as the computation takes them; a value no control could send is refused."""
        if head_fusion not in HEAD_FUSIONS:
            raise UserError(f"head fusion: expected one of {', '.join(HEAD_FUSIONS)}, got {str(head_fusion)[:40]!r}")
        if not isinstance(discard_ratio, numbers.Real) or not 0.0 <= discard_ratio < 1.0:
            raise UserError(f"discard ratio: expected a number from 0 up to 1, got {str(discard_ratio)[:40]!r}")
        if not isinstance(k, numbers.Real) or not math.isfinite(k) or k != int(k) or k < 1:  # more: all classes
            raise UserError(f"top-k: expected a whole number of 1 or more, got {str(k)[:40]!r}")
        return head_fusion, float(discard_ratio), int(k)

    def upload(self, image: dict | None) -> Image.Image:
        """The uploaded file decoded for this model (`read_upload`: a large JPEG at the reduced
        scale `decode_side` keeps)."""
        return read_upload(image, decode_side(self.predictor.config))

    def predict(self, image: dict | None, head_fusion: str, discard_ratio: float, k: int,
                method: str | None = None) -> tuple[dict[str, float], dict]:
        """Top-k labels and the method's map as numbers (`pictures.map_values`)."""
        method = method or self.default_method
        view = to_model_domain(self.upload(image), self.predictor.config)
        result = answer(self.predictor, view, *self.controls(head_fusion, discard_ratio, k), method)
        return result.scores, map_values(method, result.method_map, self.predictor.config)

    def predict_labels(self, image: dict | None, k: int = 3) -> dict[str, float]:
        """The top-k labels only: no map, no pictures."""
        config = self.predictor.config
        k = self.controls(HEAD_FUSIONS[0], 0.0, k)[2]
        probabilities, _ = self.predictor.predict(model_pixels(to_model_domain(self.upload(image), config), config)[None])
        return dict(top_k(probabilities, config.labels, k)[0])

    def explain(self, image: dict | None, head_fusion: str, discard_ratio: float, k: int,
                method: str | None = None) -> tuple:
        """What the page shows: labels, the map over the image, the per-layer strip, the model's
        input and the per-head maps."""
        return self._pictures(to_model_domain(self.upload(image), self.predictor.config),
                              head_fusion, discard_ratio, k, method)

    def explain_drawing(self, drawing: dict | None, head_fusion: str, discard_ratio: float, k: int,
                        method: str | None = None) -> tuple:
        """Like explain, for a drawing; the overlay shows the centred digit the model saw."""
        return self._pictures(read_drawing(drawing, self.predictor.config.image_size),
                              head_fusion, discard_ratio, k, method)

    def _pictures(self, view: Image.Image, head_fusion: str, discard_ratio: float, k: int,
                  method: str | None) -> tuple:
        controls = self.controls(head_fusion, discard_ratio, k)
        result = explain(self.predictor, view, *controls, method or self.default_method)
        result.overlay.encoderinfo = {"compress_level": OVERLAY_PNG_LEVEL}  # Pillow's options for a save
        return result.scores, result.overlay, result.strip, result.model_input, result.heads


def build_demo(predictor: Predictor) -> gr.Blocks:
    """The Gradio app for one predictor. Launch it with `serve(demo, ...)`."""
    predictor.config.check_has_head("the app")
    handlers = Handlers(predictor, opening_method(predictor))
    with gr.Blocks(title="vit_hub: what the ViT looks at", analytics_enabled=False,
                   delete_cache=(600, 3600)) as demo:
        _header(predictor, handlers.default_method)
        views = _views_or_error(predictor)  # computed once, at start-up
        with gr.Tabs():
            with gr.Tab("Classify"):
                _classify_tab(handlers)
            with gr.Tab("Inside the model", elem_id="inside"):
                _inside_tab(views)
    return demo


def _header(predictor: Predictor, default_method: str) -> None:
    config = predictor.config
    gr.Markdown(f"## vit_hub: what the Vision Transformer looks at\n{_invitation(config)}: the model names "
                f"what it sees, and the map shows which patches made it say so.")
    with gr.Accordion("How faithful is this map?", open=False):
        gr.Markdown(
            f"The map opens with **{METHODS[default_method].label}**: {METHODS[default_method].meaning}; "
            f"Explanation changes the method. The model: {config.num_classes} classes, "
            f"{size_text(config.image_size)} input, {config.depth} layers, on "
            f"{predictor.description}.\n\n{faithfulness_table(predictor.model_dir, predictor.methods)}"
            + ("" if len(predictor.methods) == len(METHODS) else
               "\n\nThe methods that need gradients are offered with `--backend torch` only.")
        )


def _classify_tab(handlers: Handlers) -> None:
    """Inputs and controls on the left, the answer on the right; the four endpoints wired."""
    config = handlers.predictor.config
    with gr.Row():
        with gr.Column():
            image, drawing, submit, submit_drawing = _inputs(config, example_images(handlers.predictor.model_dir, config))
            controls = _controls(handlers)
        with gr.Column():
            outputs = _outputs(config)
    label = outputs[0]
    queued = dict(concurrency_id="model", concurrency_limit=CONCURRENCY_LIMIT)
    # preprocess=False: the handler opens the upload itself, so a non-image gets a clear gr.Error.
    # Gradio then does not check the path, so read_upload does: only uploads are opened.
    submit.click(user_errors(handlers.explain), [image, *controls], outputs, api_name="explain",
                 preprocess=False, **queued)
    # API only: these buttons are never shown, their events are the named endpoints.
    explanation_map = gr.JSON(visible=False, label="Explanation map")  # named in the API (else value_N)
    gr.Button(visible=False).click(user_errors(handlers.predict), [image, *controls], [label, explanation_map],
                                   api_name="predict", preprocess=False, **queued)
    gr.Button(visible=False).click(user_errors(handlers.predict_labels), [image, controls[2]], label,
                                   api_name="predict_labels", preprocess=False, **queued)
    if drawing is not None:
        submit_drawing.click(user_errors(handlers.explain_drawing), [drawing, *controls], outputs,
                             api_name="explain_drawing", **queued)


def _invitation(config: ViTConfig) -> str:
    """What the page asks for, in the model's own words: its labels (a few of them when many)."""
    if is_digit_model(config):
        return "Upload an image of a digit or draw one"
    labels = config.labels
    named = ", ".join(labels[:MAX_LABELS_NAMED]) + (f" and {len(labels) - MAX_LABELS_NAMED} more classes"
                                                    if len(labels) > MAX_LABELS_NAMED else "")
    return f"Upload an image of one of {len(labels)} classes ({named})"


def _inputs(config: ViTConfig, examples: list[Path]) -> tuple[gr.Image, Any, gr.Button, Any]:
    """(upload, drawing, their buttons); a drawing for a digit model only."""
    drawing = submit_drawing = None
    with gr.Tabs():
        with gr.Tab("Upload"):
            image = gr.Image(type="filepath", label="Image", sources=["upload", "clipboard"], height=320,
                             elem_id="upload")
            submit = gr.Button("Classify", variant="primary")
            gr.Markdown(f"Images of {pixel_limit(APP_MAX_PIXELS)} (a larger JPEG photo is read scaled down), "
                        f"files of at most {MAX_FILE_SIZE}.",
                        elem_id="upload-limits")
            if examples:
                gr.Examples([[str(path)] for path in examples], inputs=[image], label="Examples",
                            examples_per_page=len(examples))
        if is_digit_model(config):
            with gr.Tab("Draw"):
                drawing = checked_sketchpad(
                    type="pil", image_mode="RGB", canvas_size=(400, 400), layers=False,
                    label="Draw a digit (pick the brush on the left first)", elem_id="drawing",
                    brush=gr.Brush(default_size=14, colors=["#000000"], color_mode="fixed"),
                )
                submit_drawing = gr.Button("Classify drawing", variant="primary")
    return image, drawing, submit, submit_drawing


def _controls(handlers: Handlers) -> list:
    """[head fusion, discard ratio, top-k, method]: the order every endpoint takes them in."""
    predictor = handlers.predictor
    method = gr.Dropdown([(METHODS[name].label, name) for name in predictor.methods],
                         value=handlers.default_method, label="Explanation", elem_id="method",
                         info="what the overlay shows; the strip below it is always rollout")
    head_fusion = gr.Radio(list(HEAD_FUSIONS), value=DEFAULT_HEAD_FUSION, label="Head fusion")
    discard_ratio = gr.Slider(0.0, 0.95, value=DEFAULT_DISCARD_RATIO, step=0.05, label="Discard ratio",
                              info="share of the weakest attention weights dropped per layer")
    classes = predictor.config.num_classes
    k = whole_number_slider(1, classes, value=min(3, classes), step=1, label="Top-k")
    return [head_fusion, discard_ratio, k, method]


def _outputs(config: ViTConfig) -> list:
    """[labels, overlay, per-layer strip, model input, head grid]. PNG for the overlay and the
    model's input, whose pixels stay exact (the overlay is the one the Node example and the
    static Space draw, pixel for pixel); JPEG for the strip and the head grid: it encodes far
    faster than PNG with no visible loss on those small heat maps."""
    pictures = dict(type="pil", interactive=False)
    buttons = ["download", "fullscreen"]
    return [
        gr.Label(label="Prediction"),
        gr.Image(label="Explanation", format="png", buttons=buttons, elem_id="rollout", **pictures),
        gr.Image(label="Rollout after layer 1, 2, ... (left to right)", format="jpeg", buttons=buttons,
                 elem_id="layer-strip", **pictures),
        gr.Image(label=_model_input_label(config), format="png", height=160, elem_id="model-input", **pictures),
        gr.Image(label=f"Each head's attention from the {pooled_token(config)}: a row per layer (layer 1 at the "
                       f"top), a column per head", format="jpeg", buttons=buttons, height=420,
                 elem_id="head-maps", **pictures),
    ]


def whole_number_slider(*args: Any, **kwargs: Any) -> gr.Slider:
    """A gr.Slider of whole numbers whose type in the API is integer (a slider's is a float).
    The instance's api_info is replaced: a subclass would make Gradio write a .pyi file beside
    this module."""
    slider = gr.Slider(*args, **kwargs)
    info = {**slider.api_info(), "type": "integer"}
    slider.api_info = lambda: info
    return slider


def model_views(predictor: Predictor) -> ModelViews:
    """Views 1-3 of the served model: from its weights when the backend has them, with attention
    distances measured on the bundled samples when they fit the model (a digit model), else on
    the model dir's own samples."""
    config = predictor.config
    weights = predictor.weights() if hasattr(predictor, "weights") else None
    data = default_data(config, predictor.model_dir)
    pixels, note = None, ("no images to measure on here: the bundled samples fit only a digit model and the "
                          "model keeps no samples of its own (`vit-hub inspect --model MODEL --data IMAGES` "
                          "measures it)")
    if data is not None:
        pixels, note = load_pixels(data, config)
    return compute_views(config, weights, lambda batch: predictor.predict(batch)[1], pixels, note)


def _views_or_error(predictor: Predictor) -> ModelViews | str:
    try:
        return model_views(predictor)
    except (OSError, UserError) as error:  # shown on the tab; the classifier still works
        return f"The views could not be computed: {without_paths(str(error))}"


def _inside_tab(views: ModelViews | str) -> None:
    """Views 1-3 of the model, each with its one-sentence reading (or the reason it is missing)."""
    gr.Markdown("What the model learned, as the ViT paper shows it (Dosovitskiy et al. 2021, Figure 7): the "
                "filters its patch projection applies, how alike its position embeddings are, and how far "
                "each head looks. The per-head maps of one image are under the rollout on the Classify tab.")
    if isinstance(views, str):
        gr.Markdown(views)
        return
    images, readings = view_images(views), views.readings()
    for name, title in INSIDE_TITLES.items():  # three views
        gr.Image(images[name], label=title, type="pil", format="png", interactive=False, show_label=True,
                 buttons=["download", "fullscreen"], elem_id=f"inside-{name.replace('_', '-')}")
        gr.Markdown(readings[name])


def _model_input_label(config: ViTConfig) -> str:
    size = size_text(config.image_size)
    if config.canonicalize == "digit":
        return f"What the model saw: the digit cropped, centred and scaled like MNIST ({size})"
    return f"What the model saw ({size})"


def serve(demo: gr.Blocks, host: str = "127.0.0.1", port: int | None = None, **launch: Any):
    """Queue and launch with the safe defaults: no share link, no SSR, capped uploads."""
    message_gradio_refusals()
    map_large_blocks()  # so memory comes back after a burst of large uploads
    demo.queue(max_size=QUEUE_SIZE, default_concurrency_limit=CONCURRENCY_LIMIT)
    return demo.launch(server_name=host, server_port=port, share=False, ssr_mode=False,
                       max_file_size=MAX_FILE_SIZE, css=CSS, state_session_capacity=SESSIONS_KEPT, **launch)
