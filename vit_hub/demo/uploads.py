"""What a request sends, checked: every request is untrusted.

Only files uploaded to this app are opened (never a path a client names), each image's size
is read from its header before it is decoded, and a message never shows a server path: a
problem is one `gr.Error` line naming the client's own file name.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import gradio as gr
from gradio.data_classes import FileData
from gradio.utils import get_upload_folder
from PIL import Image

from vit_hub.errors import UserError
from vit_hub.processing.canonical import EmptyImageError, centre_digit
from vit_hub.processing.preprocess import UPLOAD_MAX_PIXELS, check_header, load_image, open_image, to_model_mode

MAX_FILE_SIZE = "20mb"
# Largest image a request may send (pixels, read from its header before it is decoded): a 12 MP
# phone photo fits. Decoding and converting an RGBA image holds about 15 bytes a pixel, so the
# requests in flight (page.CONCURRENCY_LIMIT) hold at most about 1 GB.
APP_MAX_PIXELS = UPLOAD_MAX_PIXELS
MAX_NAME_CHARS = 80  # of a client's file name, when a message names it
# An absolute path in a message: /dir/.../name or C:\dir\...\name; `name` is its last part.
ABSOLUTE_PATH = re.compile(r"(?:(?<![\w.~])/|\b[A-Za-z]:[\\/])(?:[^\s/\\'\"]+[/\\])*(?P<name>[^\s/\\'\"]*)")


def read_upload(upload: dict | str | None, min_side: int | None = None) -> Image.Image:
    """A file this client uploaded (Gradio's file data) -> decoded PIL image, upright.

    Anything unusable raises gr.Error naming the client's own file name, never a server
    path. The size is checked from the header before decoding (`open_image`), so a huge
    image is refused without spending memory on it. With `min_side` (the model's
    `preprocess.decode_side`, as the page passes it) a JPEG larger than the model needs is
    decoded at a reduced scale (1/2, 1/4 or 1/8 a side) keeping that many pixels on its
    shorter side.
    """
    path, name = uploaded_file(upload)
    try:
        return load_image(open_image(path, name, APP_MAX_PIXELS, min_side))
    except (OSError, UserError) as error:
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
            except UserError as error:
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


def user_errors(handler: Callable) -> Callable:
    """Report a user's mistake (gr.Error, or a UserError from preprocessing, rollout or a backend)
    as gr.Error, with any server path in the message cut to its last part; anything else is a bug
    and reaches Gradio as it is. The gr.Error is raised afresh, after the mistake's traceback is
    gone: its frames held the request's decoded images, and Gradio keeps what it is raised with
    for a while. The memory the request freed goes back to the system."""
    @functools.wraps(handler)
    def wrapped(*args):
        outcome = _outcome(handler, args)
        del args  # the refusal's traceback holds this frame: not the request's images
        return_freed_memory()
        if isinstance(outcome, Refused):
            raise gr.Error(outcome.message, print_exception=False)  # a user's mistake: no traceback in the log
        return outcome
    return wrapped


@dataclasses.dataclass(frozen=True)
class Refused:
    message: str  # one line, no server path


def _outcome(handler: Callable, args: tuple) -> Any:
    """handler(*args), or Refused with the message of a user's mistake: the exception and its
    traceback end here."""
    try:
        return handler(*args)
    except gr.Error as error:
        return Refused(error.message)
    except UserError as error:
        return Refused(without_paths(str(error)))


# Gradio answers a request its own checks refuse before any handler runs (data that is not the
# component's, a path that was not uploaded) with {"error": null}: the client learns nothing.
# Those refusals get this line instead; the exception's own text is never sent (it can name a
# server path), only its type.
REFUSED_BY_GRADIO = ("The request was refused: expected an image uploaded to this app and the page's controls, "
                     "got data this endpoint cannot take")


def message_gradio_refusals() -> None:
    """Make Gradio's refusals without a message say REFUSED_BY_GRADIO, and log each of its
    refusals as one line (`OneLineRefusals`) (process-wide; once)."""
    import gradio.queueing
    import gradio.route_utils
    import gradio.routes
    import gradio.utils

    original = gradio.utils.error_payload
    if getattr(original, "names_the_refusal", False):
        return
    for module in (gradio.queueing, gradio.routes, gradio.route_utils, gradio.utils):
        module.traceback = OneLineRefusals()

    def error_payload(error: BaseException | None, show_error: bool) -> dict:
        content = original(error, show_error)
        if content.get("error") is None:
            content["error"] = REFUSED_BY_GRADIO + (f" ({type(error).__name__})" if error is not None else "")
        return content

    error_payload.names_the_refusal = True
    gradio.utils.error_payload = gradio.queueing.error_payload = error_payload


class OneLineRefusals:
    """The `traceback` module as Gradio's request handling sees it, except that `print_exc` logs
    an exception that never reached this project's code (Gradio's own checks refusing a slider
    value out of range or a dropdown value that is no choice) as one line, `refused a request:
    TYPE: first line`; an exception with any frame of ours is a bug and keeps its traceback."""

    def __getattr__(self, name: str) -> Any:
        return getattr(traceback, name)

    def print_exc(self, *args: Any, **kwargs: Any) -> None:
        error = sys.exc_info()[1]
        if error is None or _ran_our_code(error):
            traceback.print_exc(*args, **kwargs)
            return
        first = str(error).strip().splitlines()[0] if str(error).strip() else "no message"
        print(f"refused a request: {type(error).__name__}: {first[:300]}", file=sys.stderr, flush=True)


OUR_CODE = str(Path(__file__).resolve().parents[1]) + os.sep  # the vit_hub package: every handler of a request


def _ran_our_code(error: BaseException) -> bool:
    """Whether a frame of the exception (or of the ones it was raised from) is in vit_hub."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if any(frame.filename.startswith(OUR_CODE) for frame in traceback.extract_tb(error.__traceback__)):
            return True
        error = error.__cause__ or error.__context__
    return False


# glibc keeps the large blocks a request freed (a decoded image) for reuse in its per-thread
# arenas, so after a burst of large uploads the server would keep holding them.
# malloc_trim(0) returns them; other C libraries have no such call and need none.
_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
_MALLOC_TRIM = getattr(_LIBC, "malloc_trim", None)
# glibc gives a block over its mmap threshold a mapping of its own, unmapped when freed; but the
# threshold rises to the largest such block freed (up to 32 MB), after which decoded images come
# from the arenas, which fragment: three bursts of blank 9 MP uploads kept +190 MB. A fixed
# threshold (mallopt also stops it moving) keeps every large block mapped: +3 MB.
_MALLOPT = getattr(_LIBC, "mallopt", None)
M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 2**20


def return_freed_memory() -> None:
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def map_large_blocks() -> None:
    """Give every block over MMAP_THRESHOLD_BYTES a mapping of its own, returned when freed (glibc)."""
    if _MALLOPT is not None:
        _MALLOPT(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def without_paths(message: str) -> str:
    """Absolute paths (POSIX or Windows) in a message -> their last part, e.g. /tmp/a/x.png -> x.png."""
    return ABSOLUTE_PATH.sub(lambda match: match.group("name"), message)
