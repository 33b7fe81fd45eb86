"""A GPU server for a vit_hub model: the uploads of concurrent requests classified in one
network run, the Python app's answers.

    python examples/gpu_server.py --model models/vit-mnist [--port 8000] [--batch 64] [--wait-ms 5]
                                  [--queue 128] [--workers CORES] [--host 127.0.0.1]
    curl --data-binary @digit.png http://127.0.0.1:8000/classify
    # {"label": "7", "top": [["7", 0.998], ["2", 0.001], ...]}   or, refused: {"error": "..."} (4xx, 503)
    curl http://127.0.0.1:8000/      # {"labels": [...], "providers": {"preprocessing": [...], "network": [...]}}

How it works. uvicorn serves a FastAPI app on one event loop, which never waits on a decode or
the network itself. A request to POST /classify goes through four steps:

  1. admitted if fewer than --queue requests are in the server (default 2 x --batch), else
     refused at once with 503 and Retry-After: a burst is answered or refused, none left waiting;
  2. its body read from the stream: at most MAX_BODY_BYTES, counted as they arrive (a
     Content-Length is not trusted), else 413; within BODY_TIMEOUT_S, else 408;
  3. decoded and preprocessed (`UploadClassifier.preprocess`: pipeline.onnx's preprocessing on
     ONNX Runtime's CPU provider) in a pool of --workers threads (default one per core), so
     that at most that many decoded images exist at once; a file that is no readable image,
     or one the preprocessing refuses (no ink, too large), gets 422 and the reason in one line;
  4. handed to the batcher thread, which gathers what arrives within --wait-ms, up to --batch
     uploads, and runs the network once for all of them (on CUDA where onnxruntime-gpu and a
     GPU are there, else on the CPU).

uvicorn answers malformed HTTP (a Content-Length that is not a number) with 400 and closes a
keep-alive connection idle for 5 s; `HeadersDeadline` adds the timeout uvicorn lacks, closing a
connection that has not sent its request's headers within HEADERS_TIMEOUT_S. So memory is
bounded by the flags: --queue bodies of at most MAX_BODY_BYTES, --workers decodes (about 250 MB
each for a 16-megapixel upload) and a batch; glibc is told to give large blocks back when they
are freed (`map_large_blocks`). One process serves one GPU: docs/export.md ("On a GPU server")
says how to run one per GPU behind a load balancer. Torch is never imported. Listens on
127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import math
import queue
import socket
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from vit_hub.console import OneLineErrorParser, run_reporting_errors  # noqa: E402
from vit_hub.errors import UserError  # noqa: E402
from vit_hub.export.batched_runtime import UploadClassifier  # noqa: E402

MAX_BODY_BYTES = 20 * 2**20  # an upload's file, at most (the app's limit)
BODY_TIMEOUT_S = 30.0  # to send the body, from the request's headers
HEADERS_TIMEOUT_S = 10.0  # to send a request's headers, from connecting or from the last answer
RETRY_AFTER_S = 1  # what a 503 tells the client to wait
MAX_BATCH = 1024
TOP_K = 3


class NetworkFailed(Exception):
    """The network run an upload was in failed (CUDA out of memory, say): 500 for its request."""


class Batcher:
    """Preprocessed uploads in, probabilities out: one network run for what arrives together.

    A thread waits for the first upload, then gathers more for up to `wait_ms` or until
    `batch` are in, and runs the network once for them. Nothing a run raises stops it: the
    error is logged in one line, the uploads of that run get NetworkFailed, and it waits for
    the next. An upload whose request was cancelled is left out.
    """

    def __init__(self, classifier: UploadClassifier, batch: int, wait_ms: float):
        if batch < 1 or not 0 <= wait_ms < math.inf:
            raise UserError(f"the batcher: expected a batch of at least 1 and a finite wait of at least 0 ms, "
                            f"got {batch} and {wait_ms}")
        self.classifier, self.batch, self.wait = classifier, batch, wait_ms / 1000
        self.waiting: queue.Queue[tuple[np.ndarray, Future]] = queue.Queue()
        self.sizes: list[int] = []  # uploads in each network run so far

    @property
    def runs(self) -> int:
        """Network runs so far."""
        return len(self.sizes)

    def submit(self, pixel_values: np.ndarray) -> Future:
        """pixel_values [1, C, H, W] -> a Future of its probabilities [classes]."""
        answer: Future = Future()
        self.waiting.put((pixel_values, answer))
        return answer

    def start(self) -> None:
        self.thread = threading.Thread(target=self._serve, daemon=True, name="batcher")
        self.thread.start()

    def _serve(self) -> None:
        while True:
            self._run(self._gather())

    def _gather(self) -> list[tuple[np.ndarray, Future]]:
        """The first upload to come, then more until the batch is full or the wait is over."""
        gathered = [self.waiting.get()]
        deadline = time.monotonic() + self.wait
        while len(gathered) < self.batch and (left := deadline - time.monotonic()) > 0:
            try:
                gathered.append(self.waiting.get(timeout=left))
            except queue.Empty:
                break
        return [(pixels, answer) for pixels, answer in gathered if answer.set_running_or_notify_cancel()]

    def _run(self, gathered: list[tuple[np.ndarray, Future]]) -> None:
        if not gathered:  # every request of this batch was cancelled
            return
        try:
            rows = self.classifier.probabilities(np.concatenate([pixels for pixels, _ in gathered]))
        except Exception as error:  # noqa: BLE001 - every waiting request hears of it; the thread goes on
            failed = NetworkFailed(f"expected the network to run, found it failing on a batch of {len(gathered)} "
                                   f"({type(error).__name__}: {first_line(error)})")
            logging.getLogger("uvicorn.error").error(str(failed))
            for _, answer in gathered:
                answer.set_exception(failed)
            return
        self.sizes.append(len(gathered))
        for (_, answer), row in zip(gathered, rows):
            answer.set_result(row)


class Refused(Exception):
    """A request answered with an error status and one line saying why."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": str(self)}, self.status, headers=self.headers)


class Admission:
    """The requests in the server (read, decoded, waiting or in a network run): at most `limit`.
    Used from the event loop's thread only, so a plain count is safe."""

    def __init__(self, limit: int):
        self.limit, self.inside = limit, 0

    def enter(self) -> None:
        if self.inside >= self.limit:
            raise Refused(503, f"the server is busy: expected fewer than {self.limit} requests in it, found "
                               f"{self.inside}; retry after {RETRY_AFTER_S} s", {"Retry-After": str(RETRY_AFTER_S)})
        self.inside += 1

    def leave(self) -> None:
        self.inside -= 1


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes, counted as they arrive, within BODY_TIMEOUT_S."""
    declared = request.headers.get("content-length")  # h11 has checked that it is a number
    if declared is not None and int(declared) > limit:
        raise Refused(413, f"expected an image file of at most {limit} bytes, found a Content-Length of {declared}")
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise Refused(413, f"expected an image file of at most {limit} bytes, found more")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise Refused(408, f"expected the request's body within {BODY_TIMEOUT_S:g} s, found {size} bytes by then",
                      {"Connection": "close"}) from None
    except ClientDisconnect:
        raise Refused(400, f"expected a whole request body, found the client gone after {size} bytes") from None
    if not size:
        raise Refused(400, "expected an image file as the request's body, found an empty body")
    return b"".join(chunks)


def create_app(classifier: UploadClassifier, batcher: Batcher, queue_limit: int,
               max_body: int = MAX_BODY_BYTES) -> FastAPI:
    """The routes: GET / (what it serves, where each part runs) and POST /classify."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    decoders = ThreadPoolExecutor(classifier.workers, thread_name_prefix="decode")  # decodes at once, at most
    admission = Admission(queue_limit)

    @app.get("/")
    async def status() -> dict:
        return {"labels": classifier.config.labels, "providers": classifier.providers}

    @app.post("/classify")
    async def classify(request: Request) -> JSONResponse:
        try:
            admission.enter()
        except Refused as refused:
            return refused.response()
        try:
            data = await read_body(request, max_body)
            pixel_values = await asyncio.get_running_loop().run_in_executor(decoders, prepared, classifier, data)
            del data  # not kept while the upload waits for its batch
            probabilities = await asyncio.wrap_future(batcher.submit(pixel_values))
        except Refused as refused:
            return refused.response()
        except UserError as refused:  # not an image, too large, no ink, ...: the upload's fault
            return Refused(422, str(refused)).response()
        except NetworkFailed as failed:  # the server's fault, logged once for its batch
            return Refused(500, str(failed)).response()
        finally:
            admission.leave()
        top = top_labels(probabilities, classifier.config.labels)
        return JSONResponse({"label": top[0][0], "top": top})

    @app.exception_handler(HTTPException)
    async def no_such_route(request: Request, error: HTTPException) -> JSONResponse:
        path = request.url.path[:100]
        return Refused(error.status_code, f"expected GET / or POST /classify, found {request.method} {path}",
                       error.headers).response()

    return app


def prepared(classifier: UploadClassifier, data: bytes) -> np.ndarray:
    """An uploaded file's bytes -> pixel_values [1, C, H, W], in a decode thread; the decoded
    image is freed when this returns. A large JPEG is decoded at the reduced scale the model
    needs (`UploadClassifier.decode`), never at full size."""
    return classifier.preprocess(classifier.decode(data))


# glibc serves a block under its mmap threshold from the thread's arena and keeps it there when
# freed, and the threshold rises with the largest block freed (up to 32 MB); so after a burst of
# large uploads the server went on holding what their decodes took (+190 MB after 16-megapixel
# uploads on two decode threads). A fixed threshold (mallopt also stops it moving) gives every
# block over 1 MB (a decoded image, the preprocessing's buffers) a mapping of its own, handed
# back to the system when freed: +0 MB. Other C libraries have no mallopt and need none.
M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 2**20


def map_large_blocks() -> None:
    """Every block over MMAP_THRESHOLD_BYTES in a mapping of its own, unmapped when freed (glibc)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None) if sys.platform.startswith("linux") else None
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]


def top_labels(probabilities: np.ndarray, labels: list[str]) -> list[tuple[str, float]]:
    best = np.argsort(probabilities)[::-1][:TOP_K]
    return [(labels[index], round(float(probabilities[index]), 4)) for index in best]


class HeadersDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with the timeout uvicorn lacks: a connection that has not
    sent a whole request's headers within HEADERS_TIMEOUT_S of opening, or of its last answer,
    is closed. Without it a client that connects and sends nothing, or a header a byte at a
    time, holds its connection for ever (uvicorn's keep-alive timeout restarts on every byte)."""

    _clock: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_clock()

    def on_response_complete(self) -> None:
        self._start_clock()  # first: the call below handles a request already sent (pipelined)
        super().on_response_complete()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are in: its body has BODY_TIMEOUT_S
            self._stop_clock()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        super().connection_lost(exc)

    def _start_clock(self) -> None:
        self._stop_clock()
        self._clock = self.loop.call_later(HEADERS_TIMEOUT_S, self.transport.close)

    def _stop_clock(self) -> None:
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None


class Server:
    """The server, its socket bound and listening (`port`: the one it got), serving from `serve_forever`."""

    def __init__(self, model: str, port: int = 8000, batch: int = 64, wait_ms: float = 5.0,
                 queue_limit: int | None = None, host: str = "127.0.0.1", workers: int | None = None,
                 max_body: int = MAX_BODY_BYTES):
        self.socket = listening_socket(host, port)  # first: a port in use is said before the model loads
        map_large_blocks()
        self.port = self.socket.getsockname()[1]
        self.classifier = UploadClassifier(model, batch_size=batch, workers=workers)
        self.batcher = Batcher(self.classifier, batch, wait_ms)
        self.queue_limit = queue_limit or 2 * batch
        self.app = create_app(self.classifier, self.batcher, self.queue_limit, max_body)
        config = uvicorn.Config(self.app, http=HeadersDeadline, ws="none", lifespan="off", log_level="warning",
                                access_log=False, backlog=2048)
        self.uvicorn = uvicorn.Server(config)
        self.batcher.start()

    def serve_forever(self) -> None:
        """Serve until Ctrl-C (or `shutdown`)."""
        self.uvicorn.run(sockets=[self.socket])

    def shutdown(self) -> None:
        self.uvicorn.should_exit = True


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port; a port in use or an address not of this machine is one line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise UserError(f"--host {host} --port {port}: expected an address to listen on, found it refused "
                        f"({error.strerror or error})") from None
    sock.listen(2048)
    return sock


def serve(model: str, port: int, batch: int, wait_ms: float, queue_limit: int | None = None,
          workers: int | None = None) -> Server:
    """The server, listening on 127.0.0.1:port (0: any free port), its batcher started."""
    return Server(model, port, batch, wait_ms, queue_limit, workers=workers)


def bounded(kind: type, low: float, high: float, what: str):
    """An argparse type: a `kind` number in [low, high], else one line naming what was expected."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="gpu_server.py", description=__doc__)
    parser.add_argument("--model", help="a model dir with model.onnx (and model_fp16.onnx for CUDA); required")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=bounded(int, 0, 65535, "a port from 0 to 65535"), default=8000,
                        help="the port to listen on (0: any free one)")
    parser.add_argument("--batch", type=bounded(int, 1, MAX_BATCH, f"a whole number from 1 to {MAX_BATCH}"),
                        default=64, help="uploads per network run, at most")
    parser.add_argument("--wait-ms", type=bounded(float, 0, 60_000, "milliseconds from 0 to 60000"), default=5.0,
                        help="how long a batch waits for more uploads")
    parser.add_argument("--queue", type=bounded(int, 1, 100_000, "a whole number from 1 to 100000"),
                        help="requests in the server at once, at most; more are refused with 503 (default: 2 x --batch)")
    parser.add_argument("--workers", type=bounded(int, 1, 1024, "a whole number from 1 to 1024"),
                        help="uploads decoded at once, at most (default: one per core)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.model:
        parser.error("--model: expected a model dir (with model.onnx), got none")

    def run() -> None:
        server = Server(args.model, args.port, args.batch, args.wait_ms, args.queue, args.host, args.workers)
        print(f"serving {args.model} on http://{args.host}:{server.port}/classify "
              f"(network on {server.classifier.providers['network'][0]}, batches of {args.batch}, "
              f"at most {server.queue_limit} requests in)", flush=True)
        server.serve_forever()

    return run_reporting_errors(run)


if __name__ == "__main__":
    sys.exit(main())
