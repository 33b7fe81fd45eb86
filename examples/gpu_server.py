"""A GPU server for a vit_hub model: the uploads of concurrent requests classified in one
network run, the Python app's answers.

    python examples/gpu_server.py --model models/vit-mnist [--port 8000] [--batch 64] [--wait-ms 5]
    curl --data-binary @digit.png http://127.0.0.1:8000/classify
    # {"label": "7", "top": [["7", 0.998], ["2", 0.001], ...]}   or, refused: {"error": "..."} (422)
    curl http://127.0.0.1:8000/      # {"labels": [...], "providers": {"preprocessing": [...], "network": [...]}}

Each request's thread decodes its upload and preprocesses it on ONNX Runtime's CPU provider
(`UploadClassifier.preprocess`: pipeline.onnx's preprocessing); a batcher thread gathers what
arrives within --wait-ms, up to --batch uploads, and runs the network once for all of them
(on CUDA where onnxruntime-gpu and a GPU are there, else on the CPU). Torch is never imported.
Listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import io
import json
import queue
import sys
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from vit_hub.errors import UserError  # noqa: E402
from vit_hub.export.batched_runtime import UploadClassifier, decoded_upload  # noqa: E402
from vit_hub.processing.preprocess import UPLOAD_MAX_PIXELS, check_header  # noqa: E402

MAX_BODY_BYTES = 20 * 2**20  # an upload's file, at most
TOP_K = 3


class Batcher:
    """Preprocessed uploads in, probabilities out: one network run for what arrives together."""

    def __init__(self, classifier: UploadClassifier, batch: int, wait_ms: float):
        self.classifier, self.batch, self.wait = classifier, batch, wait_ms / 1000
        self.waiting: queue.Queue[tuple[np.ndarray, Future]] = queue.Queue()
        self.runs = 0  # network runs so far

    def submit(self, pixel_values: np.ndarray) -> Future:
        """pixel_values [1, C, H, W] -> a Future of its probabilities [classes]."""
        answer: Future = Future()
        self.waiting.put((pixel_values, answer))
        return answer

    def start(self) -> None:
        threading.Thread(target=self._serve, daemon=True, name="batcher").start()

    def _serve(self) -> None:
        while True:
            gathered = [self.waiting.get()]  # wait for the first, then for more until full or late
            deadline = time.monotonic() + self.wait
            while len(gathered) < self.batch and (left := deadline - time.monotonic()) > 0:
                try:
                    gathered.append(self.waiting.get(timeout=left))
                except queue.Empty:
                    break
            self._run(gathered)

    def _run(self, gathered: list[tuple[np.ndarray, Future]]) -> None:
        try:
            rows = self.classifier.probabilities(np.concatenate([pixels for pixels, _ in gathered]))
        except Exception as error:  # noqa: BLE001 - every waiting request hears of it
            for _, answer in gathered:
                answer.set_exception(error)
            return
        self.runs += 1
        for (_, answer), row in zip(gathered, rows):
            answer.set_result(row)


def handler_for(classifier: UploadClassifier, batcher: Batcher) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            """Whether it serves, and where each part runs."""
            self._reply(200, {"labels": classifier.config.labels, "providers": classifier.providers})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/classify":
                return self._reply(404, {"error": "expected POST /classify"})
            size = int(self.headers.get("Content-Length") or 0)
            if not 0 < size <= MAX_BODY_BYTES:
                return self._reply(413, {"error": f"expected an image file of at most {MAX_BODY_BYTES} bytes"})
            try:
                pixel_values = classifier.preprocess(decoded_bytes(self.rfile.read(size)))
            except UserError as refused:
                return self._reply(422, {"error": str(refused)})
            top = top_labels(batcher.submit(pixel_values).result(), classifier.config.labels)
            self._reply(200, {"label": top[0][0], "top": top})

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:  # quiet: one line per request is noise here
            pass

    return Handler


def decoded_bytes(data: bytes) -> np.ndarray:
    """An uploaded file's bytes -> uint8 [height, width, channels]: the size from the header first."""
    check_header(data, "the upload", UPLOAD_MAX_PIXELS)
    try:
        return decoded_upload(Image.open(io.BytesIO(data)))
    except (OSError, SyntaxError, ValueError) as error:
        raise UserError(f"the upload is not a readable image: expected image data, found data that does not "
                        f"decode ({type(error).__name__})") from None


def top_labels(probabilities: np.ndarray, labels: list[str]) -> list[tuple[str, float]]:
    best = np.argsort(probabilities)[::-1][:TOP_K]
    return [(labels[index], round(float(probabilities[index]), 4)) for index in best]


def serve(model: str, port: int, batch: int, wait_ms: float) -> ThreadingHTTPServer:
    """The server, listening on 127.0.0.1:port (0: any free port), its batcher started."""
    classifier = UploadClassifier(model, batch_size=batch)
    batcher = Batcher(classifier, batch, wait_ms)
    batcher.start()
    server = ThreadingHTTPServer(("127.0.0.1", port), handler_for(classifier, batcher))
    server.batcher = batcher
    return server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model dir with model.onnx (and model_fp16.onnx for CUDA)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=64, help="uploads per network run, at most (default 64)")
    parser.add_argument("--wait-ms", type=float, default=5.0, help="how long a batch waits for more (default 5)")
    args = parser.parse_args()
    server = serve(args.model, args.port, args.batch, args.wait_ms)
    print(f"serving {args.model} on http://127.0.0.1:{server.server_address[1]}/classify "
          f"(network on {server.batcher.classifier.providers['network'][0]})", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
