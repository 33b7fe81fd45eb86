"""Run an exported vit_hub model with ONNX Runtime. This module never imports torch.

    classifier = OnnxClassifier("models/vit-mnist/model.onnx")   # config.json beside it
    classifier = OnnxClassifier.from_model("you/vit-mnist")     # a model dir or a Hub repo id
    classifier.providers                  # e.g. ['CPUExecutionProvider']
    classifier.predict("digit.png", top_k=3)                   # [(label, probability), ...]
    logits = classifier.run(pixel_values)                      # [B, classes]
    logits, attentions = classifier.run(pixel_values, output_attentions=True)
    # attentions [depth, B, heads, T, T] come from model_attentions.onnx (export --output-attentions)

Providers: "auto" uses CUDA when this onnxruntime build has it and it starts, else the CPU;
"cuda" asks for CUDA and warns once if it falls back; "cpu"; or an onnxruntime provider
list. With a provider asked for by name, `strict=True` raises instead of falling back.
On CUDA the input is bound once and the outputs are allocated on the device (IO binding).

Exact parity: on CUDA, onnxruntime runs float32 matrix products in TF32 by default, which
puts logits about 1e-3 away from torch's float32 (measured on an H100, ViT-S/16).
`exact=True` passes the CUDA provider option `use_tf32=0`: full float32, the same numbers
as torch within 1e-5, somewhat slower. On the CPU it changes nothing.

Graphs are untrusted input: each is checked (`graph_check.check_graph`) before a session is
created, and must carry the sha256 of the weights it was exported from; a graph exported
from other weights than the model.safetensors beside it, or a logits and attentions graph
from different weights, is refused. A file that is not such a graph, or that onnxruntime
cannot load or run, raises OnnxModelError naming it, in one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import re
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from vit_hub.config import ViTConfig
from vit_hub.hub import resolve_model_dir
from vit_hub.layout import ExportLayout
from vit_hub.postprocess import softmax
from vit_hub.postprocess import top_k as rank_top_k
from vit_hub.preprocess import ImageInput, preprocess_batch

from .graph_check import ATTENTIONS, INPUT, LOGITS, OnnxModelError, check_graph, tied_weights, weights_sha256

logger = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
# HEURISTIC picks convolution algorithms without benchmarking them at start-up.
CUDA_OPTIONS = {"cudnn_conv_algo_search": "HEURISTIC"}
ORT_DEFAULT_LOG_SEVERITY = 2  # warning; onnxruntime offers no getter to save and restore it
PRECISIONS = ("fp32", "fp16")
# A failed run raises OnnxModelError with onnxruntime's message: its own log line would repeat it.
QUIET_RUN = ort.RunOptions()
QUIET_RUN.log_severity_level = 4  # of the exported graphs (fp16: `python -m export --precision fp16`)


class ProviderFallbackError(RuntimeError):
    """The requested execution provider could not be used and `strict=True` was given."""


# What onnxruntime raises for a file it cannot load or run (none of them is an OSError or ValueError).
ORT_ERRORS = (ort_state.InvalidProtobuf, ort_state.InvalidGraph, ort_state.NoSuchFile, ort_state.Fail,
              ort_state.NotImplemented, ort_state.InvalidArgument, ort_state.RuntimeException)


def _provider_name(provider: str | tuple[str, dict]) -> str:
    return provider[0] if isinstance(provider, tuple) else provider


def requested_providers(providers: str | Sequence[Any], exact: bool = False) -> tuple[list[Any], bool]:
    """("auto" | "cpu" | "cuda" | onnxruntime provider list) -> (provider list, explicit).

    `explicit` is False for "auto": falling back from CUDA there is expected, not warned about.
    `exact` turns TF32 off in the CUDA provider (see the module docstring).
    """
    wanted, explicit = _requested(providers)
    return ([_without_tf32(provider) for provider in wanted] if exact else wanted), explicit


def _without_tf32(provider: str | tuple[str, dict]) -> str | tuple[str, dict]:
    """The CUDA provider with `use_tf32=0` added to its options; any other provider as it is."""
    if _provider_name(provider) != CUDA:
        return provider
    options = provider[1] if isinstance(provider, tuple) else {}
    return CUDA, {**options, "use_tf32": "0"}


def _requested(providers: str | Sequence[Any]) -> tuple[list[Any], bool]:
    if providers == "auto":
        if CUDA in ort.get_available_providers():
            return [(CUDA, dict(CUDA_OPTIONS)), CPU], False
        return [CPU], False
    if providers == "cpu":
        return [CPU], True
    if providers == "cuda":
        return [(CUDA, dict(CUDA_OPTIONS)), CPU], True
    if isinstance(providers, (list, tuple)) and providers and not isinstance(providers, str):
        return list(providers), True
    raise ValueError(f"providers: expected 'auto', 'cpu', 'cuda' or a list of onnxruntime providers, got {providers!r}")


def _nvidia_driver_loads() -> bool:
    """Whether the CUDA driver library can be loaded (without it CUDA cannot start)."""
    if sys.platform == "darwin":
        return False
    try:
        ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return False
    return True


def _cuda_can_start() -> bool:
    return CUDA in ort.get_available_providers() and _nvidia_driver_loads()


def cuda_unavailable_reason() -> str:
    """Why the CUDA provider did not start, as far as can be told without onnxruntime's log."""
    if CUDA not in ort.get_available_providers():
        return "this onnxruntime build has no CUDA provider (install onnxruntime-gpu, and not onnxruntime beside it)"
    if not _nvidia_driver_loads():
        return "no NVIDIA driver on this machine (libcuda could not be loaded)"
    return ("the CUDA 13 / cuDNN 9 libraries or a supported GPU are missing "
            "(onnxruntime.set_default_logger_severity(0) shows its own log)")


@contextlib.contextmanager
def _quiet_onnxruntime():
    """Silence onnxruntime's own error and warning lines while CUDA is tried: the classifier
    reports a fallback once, itself."""
    ort.set_default_logger_severity(4)
    try:
        yield
    finally:
        ort.set_default_logger_severity(ORT_DEFAULT_LOG_SEVERITY)


def choose_precision(precision: str, providers: list[Any], cuda_starts: bool, fp16_exported: bool) -> str:
    """Which graph a classifier loads: the one asked for, or with "auto" the float16 copy
    when CUDA will run it and one was exported (on the CPU float16 only costs time)."""
    if precision != "auto" and precision not in PRECISIONS:
        raise ValueError(f"precision: expected 'auto', {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    if precision != "auto":
        return precision
    on_cuda = _provider_name(providers[0]) == CUDA and cuda_starts
    return "fp16" if on_cuda and fp16_exported else "fp32"


def create_session(path: Path, providers: list[Any], threads: int | None = None,
                   config: ViTConfig | None = None) -> ort.InferenceSession:
    """An inference session on the first provider that starts (onnxruntime's own fallback), for
    a graph that passed `check_graph` against `config` (default: the config.json beside it)."""
    check_graph(path, config or ViTConfig.from_json(ExportLayout.for_model(path).config))
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    if _provider_name(providers[0]) != CUDA:
        return _session(path, options, providers)
    if not _cuda_can_start():  # skip the slow attempt and onnxruntime's own warnings
        return _session(path, options, providers[1:] or [CPU])
    with contextlib.suppress(OSError):  # CUDA/cuDNN from the nvidia-* wheels, as torch would load them
        ort.preload_dlls()
    with _quiet_onnxruntime():
        return _session(path, options, providers)


def _session(path: Path, options: ort.SessionOptions, providers: list[Any]) -> ort.InferenceSession:
    """ort.InferenceSession, with a file it cannot load reported as OnnxModelError."""
    try:
        return ort.InferenceSession(str(path), options, providers=providers)
    except ORT_ERRORS as error:
        raise OnnxModelError(f"{path}: expected an ONNX model onnxruntime can load, found one it cannot "
                             f"({_ort_detail(error)})") from None


def _ort_detail(error: Exception) -> str:
    """onnxruntime's message in one line, without its prefix and the path it repeats."""
    detail = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", str(error).strip().splitlines()[0])
    detail = detail.split(" failed:", 1)[-1].strip()  # "Load model from <path> failed: <why>"
    return f"{type(error).__name__}: {detail[:300]}"


class OnnxClassifier:
    """An exported model (`model.onnx` + `config.json`) behind a small classification API.

    Args:
        model_path: the .onnx file, or a folder holding model.onnx.
        config_path: the model's config.json; default: config.json beside the model.
        providers: "auto", "cpu", "cuda" or an onnxruntime provider list (see module docstring).
        strict: raise ProviderFallbackError instead of falling back from a provider asked
            for by name ("cuda" or a list); "auto" takes whatever starts.
        exact: on CUDA, full float32 instead of TF32 (`use_tf32=0`), for parity with torch.
        precision: "fp32", "fp16" (the float16 copies, `export --precision fp16`), or "auto":
            fp16 when CUDA runs the model and the copy exists, else fp32.
        threads: onnxruntime intra-op threads (default: onnxruntime's choice, one per core).
        io_binding: bind inputs/outputs to the device; default: on when CUDA runs the model.
    """

    def __init__(self, model_path: str | Path, config_path: str | Path | None = None,
                 providers: str | Sequence[Any] = "auto", strict: bool = False,
                 threads: int | None = None, io_binding: bool | None = None, exact: bool = False,
                 precision: str = "auto"):
        self.layout = ExportLayout.for_model(model_path)
        self.model_path = self.layout.logits
        self.model_dir = self.layout.folder  # from_model: the model's own folder, which holds its weights
        if not self.model_path.is_file():
            raise FileNotFoundError(
                f"expected an ONNX model at {self.model_path}, found nothing "
                f"(export one with: python -m export --model MODEL_DIR --out {self.model_path})"
            )
        self.config = ViTConfig.from_json(config_path or self.layout.config)
        wanted, explicit = requested_providers(providers, exact)
        self._threads = threads
        fp16_exported = self.layout.in_precision(self.model_path, "fp16").is_file()
        self.precision = choose_precision(precision, wanted, _cuda_can_start(), fp16_exported)
        self.session = create_session(self._graph(self.model_path), wanted, threads, self.config)
        if precision == "auto" and self.precision == "fp16" and self.session.get_providers()[0] != CUDA:
            self.precision = "fp32"  # CUDA did not start after all
            self.session = create_session(self.model_path, wanted, threads, self.config)
        self._providers = self._check_fallback(wanted, explicit, strict)
        self._device = "cuda" if self.providers[0] == CUDA else "cpu"
        self._io_binding = self._device == "cuda" if io_binding is None else io_binding
        self.weights_sha256 = self._check_weights(self.session, self._graph(self.model_path))
        self._attentions: ort.InferenceSession | None = None
        self._attentions_lock = threading.Lock()

    @classmethod
    def from_model(cls, reference: str | Path, *, output_attentions: bool = False,
                   export_dir: Callable[[Path], Path] | None = None, revision: str | None = None,
                   token: str | None = None, **options: Any) -> "OnnxClassifier":
        """A model dir or Hub repo id, resolved as `vit_hub.load_model` resolves it (one-line
        HubErrors, HF_ENDPOINT, the config checked first), with the ONNX graphs it ships.

        When the graph needed (the attentions graph with `output_attentions`) is missing,
        `export_dir(model_dir)` names a folder to export into (torch is loaded for that);
        without `export_dir` a FileNotFoundError names the export command. `options` go to
        the constructor.
        """
        model_dir = resolve_model_dir(reference, revision, token, with_onnx=True)
        layout = ExportLayout.for_model(model_dir)
        graph = layout.attentions if output_attentions else layout.logits
        folder = model_dir
        if not graph.is_file():
            if export_dir is None:
                raise FileNotFoundError(f"expected {graph.name} in {model_dir}, found none; export it with: "
                                        f"python -m export --model {reference} --out {model_dir} --output-attentions")
            from .pipeline import export_onnx  # torch, only when there is something to export

            folder = export_dir(model_dir)
            export_onnx(model_dir, folder, output_attentions=output_attentions)
        classifier = cls(folder, **options)
        classifier.model_dir = model_dir
        return classifier

    def _graph(self, graph: Path) -> Path:
        """`graph` in this classifier's precision; a missing float16 copy names the export command."""
        path = self.layout.in_precision(graph, self.precision)
        if not path.is_file():
            raise FileNotFoundError(f"precision fp16: expected {path.name} beside {graph.name}, found none; export "
                                    f"it with: python -m export --model MODEL_DIR --out {self.model_path} --precision fp16")
        return path

    # Providers ---------------------------------------------------------------------
    @property
    def providers(self) -> list[str]:
        """The execution providers the session runs on, in priority order (`session.get_providers()`)."""
        return self.session.get_providers()

    def _check_fallback(self, wanted: list[Any], explicit: bool, strict: bool) -> list[Any]:
        """Report a fallback (warning if the provider was asked for by name, error if strict);
        returns the providers later sessions should use."""
        first, active = _provider_name(wanted[0]), self.providers[0]
        if first == active:
            return wanted
        reason = cuda_unavailable_reason() if first == CUDA else "it could not be created"
        message = f"{first} was requested but {reason}; running on {active} instead"
        if not explicit:  # "auto" asked for the best available provider and got it
            logger.info(message)
        elif strict:
            raise ProviderFallbackError(message)
        else:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return self.providers

    # Graphs ------------------------------------------------------------------------
    def _check_weights(self, session: ort.InferenceSession, path: Path, paired_with: str | None = None) -> str:
        """The sha256 of the weights the graph was exported from (its metadata); refused when it
        has none, when it is not `paired_with` (the logits graph's), or when the model.safetensors
        beside it has another."""
        found = tied_weights(session.get_modelmeta().custom_metadata_map)
        fix = f"export again: python -m export --model MODEL_DIR --out {self.layout.folder}"
        if found is None:
            raise OnnxModelError(f"{path}: expected the sha256 of the weights it was exported from in its metadata, "
                                 f"found none; {fix}")
        weights = self.layout.weights
        if paired_with not in (None, found):
            raise OnnxModelError(f"{path} and {self.model_path.name} were exported from different weights: expected "
                                 f"the pair one export writes, found sha256 {found[:12]}... and {paired_with[:12]}...; "
                                 f"{fix} --output-attentions")
        if weights.is_file() and found != self._sha256_beside:
            raise OnnxModelError(f"{path} was exported from other weights than the {weights.name} beside it: expected "
                                 f"sha256 {self._sha256_beside[:12]}..., found {found[:12]}...; {fix}")
        return found

    @functools.cached_property
    def _sha256_beside(self) -> str:
        return weights_sha256(self.layout.weights)

    @property
    def can_output_attentions(self) -> bool:
        """Whether run(..., output_attentions=True) can work (an attentions graph was exported)."""
        return self._outputs_attentions(self.session) or self.layout.attentions.is_file()

    @staticmethod
    def _outputs_attentions(session: ort.InferenceSession) -> bool:
        return ATTENTIONS in [output.name for output in session.get_outputs()]

    def _attentions_session(self) -> ort.InferenceSession:
        """The graph with an attentions output, loaded on first use."""
        if self._outputs_attentions(self.session):
            return self.session
        with self._attentions_lock:
            if self._attentions is None:
                path = self.layout.attentions
                if not path.is_file():
                    raise ValueError(
                        f"attentions were asked for but {path} does not exist; "
                        f"export it with: python -m export --model MODEL_DIR --out {self.model_path} --output-attentions"
                    )
                half = self.layout.in_precision(path, self.precision)  # an fp16 copy when there is one
                graph = half if half.is_file() else path
                session = create_session(graph, self._providers, self._threads, self.config)
                self._check_weights(session, graph, paired_with=self.weights_sha256)
                self._attentions = session
        return self._attentions

    # Inference ---------------------------------------------------------------------
    def check_pixel_values(self, pixel_values: Any) -> np.ndarray:
        """Raise ValueError/TypeError naming expected vs got; returns contiguous float32 [B, C, H, W]."""
        channels, (height, width) = self.config.in_channels, self.config.image_size
        expected = f"[batch, {channels}, {height}, {width}]"
        if not isinstance(pixel_values, np.ndarray):
            raise TypeError(f"expected pixel_values as a NumPy array {expected}, got {type(pixel_values).__name__} "
                            f"(for images, use predict() or preprocess())")
        if pixel_values.ndim != 4:
            raise ValueError(f"expected pixel_values of rank 4 {expected}, got rank {pixel_values.ndim} "
                             f"with shape {list(pixel_values.shape)} (for images, use predict() or preprocess())")
        if not np.issubdtype(pixel_values.dtype, np.floating):
            raise ValueError(f"expected float pixel_values (normalised by preprocess()), got dtype {pixel_values.dtype}")
        batch, got_channels, got_height, got_width = pixel_values.shape
        if batch == 0:
            raise ValueError(f"expected at least one image in pixel_values {expected}, got batch size 0")
        if got_channels != channels:
            raise ValueError(f"expected {channels} input channels {expected}, got {got_channels}")
        if (got_height, got_width) != (height, width):
            raise ValueError(f"expected images of {height}x{width} pixels {expected}, got {got_height}x{got_width}")
        return np.ascontiguousarray(pixel_values, dtype=np.float32)

    def run(self, pixel_values: np.ndarray, output_attentions: bool = False):
        """float32 [B, C, H, W] -> logits [B, classes]; with output_attentions=True, (logits,
        attentions [depth, B, heads, T, T]) from the attentions graph. NumPy in, NumPy out."""
        pixels = self.check_pixel_values(pixel_values)
        if not output_attentions:
            return self._run(self.session, [LOGITS], pixels)[0]
        logits, weights = self._run(self._attentions_session(), [LOGITS, ATTENTIONS], pixels)
        return logits, weights

    def _run(self, session: ort.InferenceSession, outputs: list[str], pixels: np.ndarray) -> list[np.ndarray]:
        """One run; onnxruntime's own failures (out of memory, a kernel error) as OnnxModelError."""
        try:
            return self._run_once(session, outputs, pixels)
        except ORT_ERRORS as error:
            graph = self.layout.attentions if ATTENTIONS in outputs and session is not self.session else self.model_path
            raise OnnxModelError(f"{graph}: expected onnxruntime to run it on pixel_values {list(pixels.shape)}, "
                                 f"got an error ({_ort_detail(error)})") from None

    def _run_once(self, session: ort.InferenceSession, outputs: list[str], pixels: np.ndarray) -> list[np.ndarray]:
        if not self._io_binding:
            return session.run(outputs, {INPUT: pixels}, QUIET_RUN)
        binding = session.io_binding()
        binding.bind_cpu_input(INPUT, pixels)  # copied to the device once
        for name in outputs:
            binding.bind_output(name, self._device)  # allocated on the device by onnxruntime
        session.run_with_iobinding(binding, QUIET_RUN)
        return binding.copy_outputs_to_cpu()

    def preprocess(self, images: Sequence[ImageInput]) -> np.ndarray:
        """Images (paths, PIL images, arrays) -> float32 [B, C, H, W] as the config says."""
        return preprocess_batch(list(images), self.config)

    def predict(self, images: ImageInput | Sequence[ImageInput], top_k: int = 5, batch_size: int = 64):
        """Top-k (label, probability) pairs, best first: a list for one image, a list of
        such lists for a list of images."""
        self.config.check_has_head("predict")
        single = not isinstance(images, (list, tuple))
        images = [images] if single else list(images)
        if not images:
            raise ValueError("expected at least one image, got an empty list")
        ranked = []
        for start in range(0, len(images), batch_size):
            logits = self.run(self.preprocess(images[start:start + batch_size]))
            ranked += rank_top_k(softmax(logits), self.config.labels, top_k)
        return ranked[0] if single else ranked

    def __repr__(self) -> str:
        return f"OnnxClassifier({str(self.model_path)!r}, providers={self.providers})"

