"""Uploads classified the way a GPU server should: each upload preprocessed on ONNX Runtime's
CPU provider in a worker thread, then the network once for many uploads on the provider
`OnnxClassifier` picks (CUDA where it starts, with the float16 copy; else the CPU). Torch-free.

    with UploadClassifier("models/vit-mnist") as server:     # a model dir with model.onnx
        answers = server.classify([server.decode(path) for path in paths])   # one network run
    answers[0].probabilities    # float32 [classes] in config.json's label order; None if refused
    answers[0].refusal          # why it was refused, in one line ("expected an image of a digit, ...")
    server.top_k(answers[0], 3) # [(label, probability), ...], best first
    server.classify(images, explain=True)[0].map   # float32 [grid_h, grid_w]: the page's opening map

Why split: pipeline.onnx runs a digit model's canonicalisation as graph control flow, which
the CUDA provider ran 27x slower than the CPU provider on an H200 (BENCHMARKS.md, "A GPU
server"), and it takes one image.
Here the preprocessing is pipeline.onnx's own graph (`preprocess_graph`, equal to `preprocess`
bit for bit for a digit model), on the CPU, one upload per thread (they release the GIL);
the network takes a batch.

The answers are the Python app's: that preprocessing, the network graph (checked and opened
as OnnxClassifier does), a softmax at the config's temperature. The preprocessing graph is
built from config.json in memory (a third of a second), so no graph file is trusted for it;
preprocess.onnx, the same graph, is written by the export for apps in other languages.
An upload's answer does not depend on the others in its batch: the network's rows are
independent, up to the rounding of a batched matrix product (BATCH_TOLERANCE in float32 on the
CPU provider; bench/gpu_server.py measures it on CUDA).

With `explain=True` each answer also carries the map the app's page opens with for the model
and attention rollout, from the model dir's pipeline_explain.onnx (`vit-hub export
--output-attentions` writes it; its metadata names the method, `map_method`). That graph's
gradients were traced for one image, so it runs once per upload, in the worker threads beside
the preprocessing, on the CPU provider (its canonicalisation is graph control flow, as
pipeline.onnx's): each map is the graph's own answer for that upload, whatever the batch.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

from vit_hub.errors import UserError
from vit_hub.layout import MAP_METHOD_KEY, PIPELINE_INPUT, PIPELINE_MAP, PIPELINE_ROLLOUT
from vit_hub.processing.canonical import BLANK_IMAGE, NEARLY_BLANK, NO_INK
from vit_hub.processing.postprocess import softmax
from vit_hub.processing.postprocess import top_k as rank_top_k
from vit_hub.processing.preprocess import UPLOAD_MAX_PIXELS, decode_side, load_image, open_image, to_model_mode

from .pipeline_graph import TOO_LARGE, TOO_SMALL, WRONG_CHANNELS, decoded_pixels
from .preprocess_graph import preprocessing_model, preprocessing_session, run_preprocessing
from .runtime import OnnxClassifier
from .session import ORT_ERRORS, ort_detail

# Largest |batched - one at a time| per probability: float32 rounding of a batched matrix product.
BATCH_TOLERANCE = 1e-5
DEFAULT_BATCH = 64  # uploads per network run, at most
# What the preprocessing graph refuses an upload for (it quotes one in its error).
REFUSALS = (WRONG_CHANNELS, TOO_SMALL, TOO_LARGE, BLANK_IMAGE, NO_INK, NEARLY_BLANK)


@dataclass(frozen=True)
class Answer:
    """One upload's answer: its probabilities, or why it was refused."""

    probabilities: np.ndarray | None  # float32 [classes], config.json's label order
    refusal: str | None = None
    map: np.ndarray | None = None  # with explain=True: float32 [grid_h, grid_w] in [0, 1], the page's opening map
    rollout: np.ndarray | None = None  # with explain=True: float32 [grid_h, grid_w] in [0, 1], attention rollout


class UploadRefused(UserError):
    """An upload the preprocessing refuses (no ink in a digit model, too small, too large)."""


class UploadClassifier:
    """Decoded uploads -> the app's answers, the network run once for a batch of them.

    Args:
        model: a model dir (or its model.onnx), with config.json.
        providers, precision, strict, exact: the network's, as OnnxClassifier takes them
            ("auto": CUDA and the float16 copy where CUDA starts, else the CPU and float32).
        workers: uploads preprocessed at once (threads); default: one per core. Each gets
            cores // workers of onnxruntime's threads; workers=1 gives one upload the threads
            onnxruntime picks for a session (as pipeline.onnx gets them).
        batch_size: uploads per network run, at most.
    """

    def __init__(self, model: str | Path, providers: str | Sequence[Any] = "auto", precision: str = "auto",
                 strict: bool = False, exact: bool = False, workers: int | None = None,
                 batch_size: int = DEFAULT_BATCH):
        cores = available_cores()
        self.workers = cores if workers is None else workers
        if self.workers < 1 or batch_size < 1:
            raise UserError(f"workers and batch_size: expected at least 1, got {self.workers} and {batch_size}")
        # spinning=False: between batches the network's idle threads would spin on the cores the
        # preprocessing needs (a third of the CPU time per upload on two cores).
        self.network = OnnxClassifier(model, providers=providers, precision=precision, strict=strict, exact=exact,
                                      spinning=False)
        self.config = self.network.config
        self.config.check_has_head("classify uploads")
        self.batch_size = batch_size
        threads = None if self.workers == 1 else max(1, cores // self.workers)  # one: onnxruntime's own choice
        self._preprocessing = preprocessing_session(preprocessing_model(self.config), threads, arena=False)
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="vit-hub-preprocess")
        self._threads = threads
        self._explain = None  # pipeline_explain.onnx's session, opened by the first explain=True

    @property
    def providers(self) -> dict[str, list[str]]:
        """Where each part runs: {"preprocessing": [CPU], "network": the network session's providers}."""
        return {"preprocessing": self._preprocessing.get_providers(), "network": self.network.providers}

    def decode(self, source: str | Path | bytes) -> np.ndarray:
        """An upload's file (or its bytes) -> uint8 [height, width, channels], as `decoded_upload`
        decodes it for this model: a large JPEG at the reduced scale `decode_side` keeps, so a
        12-megapixel photo is never decoded or canonicalised at full size; for a digit model, its
        gray levels [height, width, 1], which is all the canonicalisation reads."""
        return decoded_upload(source, decode_side(self.config), gray=self.config.canonicalize == "digit")

    def preprocess(self, image: np.ndarray) -> np.ndarray:
        """uint8 [height, width, channels] -> pixel_values float32 [1, C, H, W]; an upload the
        graph refuses raises UploadRefused naming why."""
        try:
            return run_preprocessing(self._preprocessing, check_image(image))
        except ORT_ERRORS as error:
            raise UploadRefused(refusal(error)) from None

    def probabilities(self, pixel_values: np.ndarray) -> np.ndarray:
        """float32 [N, C, H, W] -> probabilities [N, classes], in runs of batch_size uploads."""
        logits = [self.network.run(pixel_values[start:start + self.batch_size])
                  for start in range(0, len(pixel_values), self.batch_size)]
        return softmax(np.concatenate(logits), self.config.temperature)

    def classify(self, images: Sequence[np.ndarray], explain: bool = False) -> list[Answer]:
        """Decoded uploads (uint8 [height, width, channels] each) -> an Answer each, in order:
        preprocessed in the worker threads, then the network once per batch_size of those not
        refused; with `explain`, each answer not refused also has its map and rollout (`explained`)."""
        images = [check_image(image) for image in images]
        prepared = list(self._pool.map(self._prepared, images))
        kept = [index for index, item in enumerate(prepared) if isinstance(item, np.ndarray)]
        answers = [Answer(None, item) if isinstance(item, str) else None for item in prepared]
        if kept:
            rows = self.probabilities(np.concatenate([prepared[index] for index in kept]))
            for index, row in zip(kept, rows):
                answers[index] = Answer(row)
        return self.explained(images, answers) if explain else answers

    # The page's opening map: pipeline_explain.onnx, one upload per worker thread -----------------
    @property
    def map_method(self) -> str:
        """The method `Answer.map` is (attribution.METHODS' name), as pipeline_explain.onnx's metadata names it."""
        return self._explain_session().get_modelmeta().custom_metadata_map.get(MAP_METHOD_KEY, "")

    def explained(self, images: Sequence[np.ndarray], answers: list[Answer]) -> list[Answer]:
        """The answers of `images`, each not refused with pipeline_explain.onnx's map and rollout
        of its upload, the graph run once per upload in the worker threads."""
        session = self._explain_session()
        kept = [index for index, answer in enumerate(answers) if answer.probabilities is not None]
        maps = self._pool.map(lambda index: session.run([PIPELINE_MAP, PIPELINE_ROLLOUT],
                                                        {PIPELINE_INPUT: images[index]}), kept)
        explained = list(answers)
        for index, (opening, rollout) in zip(kept, maps):
            explained[index] = replace(answers[index], map=opening, rollout=rollout)
        return explained

    def _explain_session(self):
        """pipeline_explain.onnx's CPU session, opened once; FileNotFoundError naming the export flag without it."""
        if self._explain is None:
            path = self.network.layout.pipeline_explain
            if not path.is_file():
                raise FileNotFoundError(f"explain=True: expected {path.name} in {path.parent}, found none; write it with "
                                        f"vit-hub export --model {path.parent} --out {path.parent} --output-attentions")
            self._explain = preprocessing_session(path, self._threads, arena=False)
        return self._explain

    def _prepared(self, image: np.ndarray) -> np.ndarray | str:
        """pixel_values [1, C, H, W], or the refusal's message."""
        try:
            return self.preprocess(image)
        except UploadRefused as refused:
            return str(refused)

    def top_k(self, answer: Answer, k: int = 5) -> list[tuple[str, float]]:
        """An answer's k most likely (label, probability), best first; a refused one raises UploadRefused."""
        if answer.probabilities is None:
            raise UploadRefused(answer.refusal)
        return rank_top_k(answer.probabilities[None], self.config.labels, k)[0]

    def close(self) -> None:
        self._pool.shutdown()

    def __enter__(self) -> "UploadClassifier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_image(image: Any) -> np.ndarray:
    """A decoded upload as the preprocessing graph takes it: a uint8 NumPy array [height, width,
    channels]; else TypeError or ValueError (a caller's mistake, not the upload's)."""
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:
        found = f"dtype {image.dtype}" if isinstance(image, np.ndarray) else type(image).__name__
        raise TypeError(f"expected a decoded upload as a uint8 NumPy array [height, width, channels], got {found} "
                        f"(decoded_upload() decodes a file)")
    if image.ndim != 3:
        raise ValueError(f"expected a decoded upload of rank 3 [height, width, channels], got shape {list(image.shape)}")
    return image


def refusal(error: Exception) -> str:
    """The one line an app shows for an upload the preprocessing graph refused."""
    text = str(error)
    return next((message for message in REFUSALS if message in text), ort_detail(error))


def decoded_upload(source: str | Path | bytes | Image.Image, min_side: int | None = None,
                   gray: bool = False) -> np.ndarray:
    """An upload (a file, its bytes as a server receives them, or an opened image) -> uint8
    [height, width, channels], decoded as the app decodes it: the size checked from the header,
    a JPEG over UPLOAD_MAX_PIXELS decoded reduced, and with `min_side` (the model's `decode_side`;
    UploadClassifier.decode passes it) a larger JPEG decoded at the most reduced scale that keeps
    that many pixels on its shorter side; the EXIF orientation applied. With `gray` (a digit
    model), the gray levels [height, width, 1] as `preprocess` makes them (`to_model_mode`: alpha
    over white, Pillow's convert("L")): the preprocessing graph's own conversion, bit for bit,
    done once in Pillow's C rather than as graph operators over every pixel. A file that is not
    a readable image raises UserError in one line (`open_image`)."""
    image = source if isinstance(source, Image.Image) else open_image(source, max_pixels=UPLOAD_MAX_PIXELS,
                                                                       min_side=min_side)
    image = load_image(image)
    return np.asarray(to_model_mode(image, 1))[..., None] if gray else decoded_pixels(image)


def available_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
