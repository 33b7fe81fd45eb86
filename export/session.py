"""Opening ONNX Runtime sessions: which execution providers to ask for, whether CUDA can start,
which precision's graph to load, and onnxruntime's failures as one-line errors. Torch-free.

Providers: "auto" uses CUDA when this onnxruntime build has it and it starts, else the CPU;
"cuda" asks for CUDA (a fallback is reported, see `report_fallback`); "cpu"; or an
onnxruntime provider list.

Exact parity: on CUDA, onnxruntime runs float32 matrix products in TF32 by default, which
puts its logits further from torch's float32 than the export's parity tolerance allows
(BENCHMARKS.md has the measurements). `exact=True` passes the CUDA provider option
`use_tf32=0`: full float32, within that tolerance, somewhat slower. On the CPU it changes nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from vit_hub.errors import UserError
from vit_hub.layout import ExportLayout
from vit_hub.model.config import ViTConfig

from .graph_check import OnnxModelError, check_graph
from .options import PRECISIONS

logger = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
# HEURISTIC picks convolution algorithms without benchmarking them at start-up.
CUDA_OPTIONS = {"cudnn_conv_algo_search": "HEURISTIC"}
ORT_DEFAULT_LOG_SEVERITY = 2  # warning; onnxruntime offers no getter to save and restore it
# A failed run raises OnnxModelError with onnxruntime's message: its own log line would repeat it.
QUIET_RUN = ort.RunOptions()
QUIET_RUN.log_severity_level = 4
# What onnxruntime raises for a file it cannot load or run (none of them is an OSError or ValueError).
# Session config entries that make onnxruntime's idle threads wait instead of spinning on a core.
# A thread pool spins between runs by default, which buys a little latency for back-to-back runs
# and burns a core otherwise: in UploadClassifier, whose network session ran once per batch while
# the preprocessing ran in other threads, its idle thread took a third of the CPU time per upload
# (BENCHMARKS.md, "Uploads decoded at a reduced scale").
NO_SPINNING = {"session.intra_op.allow_spinning": "0", "session.inter_op.allow_spinning": "0"}
ORT_ERRORS = (ort_state.InvalidProtobuf, ort_state.InvalidGraph, ort_state.NoSuchFile, ort_state.Fail,
              ort_state.NotImplemented, ort_state.InvalidArgument, ort_state.RuntimeException)


class ProviderFallbackError(RuntimeError):
    """The requested execution provider could not be used and `strict=True` was given: a failed
    requirement of the machine, not a mistake in what the user passed."""


# Providers ------------------------------------------------------------------------------------
def provider_name(provider: str | tuple[str, dict]) -> str:
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
    if provider_name(provider) != CUDA:
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
    raise UserError(f"providers: expected 'auto', 'cpu', 'cuda' or a list of onnxruntime providers, got {providers!r}")


def _nvidia_driver_loads() -> bool:
    """Whether the CUDA driver library can be loaded (without it CUDA cannot start)."""
    if sys.platform == "darwin":
        return False
    try:
        ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return False
    return True


def cuda_can_start() -> bool:
    return CUDA in ort.get_available_providers() and _nvidia_driver_loads()


def cuda_unavailable_reason() -> str:
    """Why the CUDA provider did not start, as far as can be told without onnxruntime's log."""
    if CUDA not in ort.get_available_providers():
        return "this onnxruntime build has no CUDA provider (install onnxruntime-gpu, and not onnxruntime beside it)"
    if not _nvidia_driver_loads():
        return "no NVIDIA driver on this machine (libcuda could not be loaded)"
    return ("the CUDA 13 / cuDNN 9 libraries or a supported GPU are missing "
            "(onnxruntime.set_default_logger_severity(0) shows its own log)")


def report_fallback(wanted: list[Any], active: str, explicit: bool, strict: bool) -> None:
    """Say so when the session runs on another provider than the first one asked for: a log line
    for "auto" (it asked for the best available provider and got it), a warning for a provider
    asked for by name, ProviderFallbackError with `strict`."""
    first = provider_name(wanted[0])
    if first == active:
        return
    reason = cuda_unavailable_reason() if first == CUDA else "it could not be created"
    message = f"{first} was requested but {reason}; running on {active} instead"
    if not explicit:
        logger.info(message)
    elif strict:
        raise ProviderFallbackError(message)
    else:
        warnings.warn(message, RuntimeWarning, stacklevel=3)  # the line that built the classifier


def choose_precision(precision: str, providers: list[Any], cuda_starts: bool, fp16_exported: bool) -> str:
    """Which graph a classifier loads: the one asked for, or with "auto" the float16 copy
    when CUDA will run it and one was exported (on the CPU float16 only costs time)."""
    if precision != "auto" and precision not in PRECISIONS:
        raise UserError(f"precision: expected 'auto', {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    if precision != "auto":
        return precision
    on_cuda = provider_name(providers[0]) == CUDA and cuda_starts
    return "fp16" if on_cuda and fp16_exported else "fp32"


# Sessions -------------------------------------------------------------------------------------
def quiet_session_options() -> ort.SessionOptions:
    """Session options that keep onnxruntime's warnings about a graph's own make-up (an unused
    constant) out of the log; errors still show."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return options


def without_spinning(options: ort.SessionOptions) -> ort.SessionOptions:
    """`options` with NO_SPINNING set: the session's idle threads sleep until it runs again."""
    for key, value in NO_SPINNING.items():
        options.add_session_config_entry(key, value)
    return options


@contextlib.contextmanager
def _quiet_onnxruntime():
    """Silence onnxruntime's own error and warning lines while CUDA is tried: the classifier
    reports a fallback once, itself."""
    ort.set_default_logger_severity(4)
    try:
        yield
    finally:
        ort.set_default_logger_severity(ORT_DEFAULT_LOG_SEVERITY)


def create_session(path: Path, providers: list[Any], threads: int | None = None,
                   config: ViTConfig | None = None, spinning: bool = True) -> ort.InferenceSession:
    """An inference session on the first provider that starts (onnxruntime's own fallback), for
    a graph that passed `check_graph` against `config` (default: the config.json beside it);
    `spinning=False` sets NO_SPINNING, for a session that shares the cores with other work."""
    check_graph(path, config or ViTConfig.from_json(ExportLayout.for_model(path).config))
    options = ort.SessionOptions() if spinning else without_spinning(ort.SessionOptions())
    if threads:
        options.intra_op_num_threads = threads
    if provider_name(providers[0]) != CUDA:
        return _session(path, options, providers)
    if not cuda_can_start():  # skip the slow attempt and onnxruntime's own warnings
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
                             f"({ort_detail(error)})") from None


def ort_detail(error: Exception) -> str:
    """onnxruntime's message in one line, without its prefix and the path it repeats."""
    detail = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", str(error).strip().splitlines()[0])
    detail = detail.split(" failed:", 1)[-1].strip()  # "Load model from <path> failed: <why>"
    return f"{type(error).__name__}: {detail[:300]}"
