"""examples/gpu_server.py, as docs/export.md ("On a GPU server") runs it: concurrent requests
get the Python route's answers, the uploads that wait together share one network run (never
more than a batch), and whatever a client sends gets an answer or a one-line refusal: a burst
of four batches (answered, or 503 with Retry-After), a body over the limit (413, counted from
the stream), one that never comes (408), headers that never come (closed), malformed HTTP
(400), a malformed image (422), a client gone before its answer; the server's log holds no
traceback and its batcher never dies. Its command line refuses a bad flag in one line, and its
memory returns to idle after a burst of 16-megapixel uploads. On the CPU provider here; a GPU
runs the same code.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import logging
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import assert_one_line
from test_malformed_images import CASES as MALFORMED
from vit_hub.export.batched_runtime import BATCH_TOLERANCE, UploadClassifier, decoded_upload
from vit_hub.processing.canonical import BLANK_IMAGE

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "vit-mnist"
SAMPLES = sorted((ROOT / "vit_hub" / "bundled" / "samples").glob("mnist_test_*_label_*.png"))
DIGIT = SAMPLES[0].read_bytes()  # a 7
HELD_MB = 50  # what a burst of large uploads may leave behind


def load_example():
    spec = importlib.util.spec_from_file_location("gpu_server", ROOT / "examples" / "gpu_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = load_example()


class LogRecords(logging.Handler):
    """Every record uvicorn, Starlette and asyncio log while a server runs in this process."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def problems(self) -> list[str]:
        """Records with a traceback, or of more than one line."""
        return [self.format(record) for record in self.records
                if record.exc_info or len(record.getMessage().splitlines()) > 1]


@contextmanager
def running(batch: int = 8, wait_ms: float = 50, queue_limit: int | None = None, workers: int = 2):
    """An example server on a free port in a thread of this process; on leaving, its log is
    checked: no traceback, no record of more than one line, and its batcher still alive."""
    server = example.serve(str(MODEL_DIR), port=0, batch=batch, wait_ms=wait_ms, queue_limit=queue_limit,
                           workers=workers)
    log = LogRecords()
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "asyncio", "")]
    for logger in loggers:
        logger.addHandler(log)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        yield server
        assert server.batcher.thread.is_alive(), "the batcher thread died"
    finally:
        server.shutdown()
        serving.join(timeout=60)
        for logger in loggers:
            logger.removeHandler(log)
    assert log.problems() == []


@pytest.fixture(scope="module")
def server():
    with running() as started:
        yield started


def post(server, data: bytes, path: str = "/classify", headers: dict | None = None) -> tuple[int, dict]:
    """One request on its own connection: (status, JSON body)."""
    status, _, body = exchange(server.port, data, path, headers)
    return status, json.loads(body)


def exchange(port: int, data: bytes, path: str = "/classify", headers: dict | None = None,
             timeout: float = 60) -> tuple[int, dict, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", path, data, headers or {})
        reply = connection.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        connection.close()


def raw(port: int, request: bytes, timeout: float = 60) -> bytes:
    """Bytes sent as they are on a new connection; all the server sends back before it closes
    (or before `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        return receive_until_closed(sock)


def receive_until_closed(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
        if b"\r\n\r\n" in received and reply_complete(received):
            break
    return received


def reply_complete(received: bytes) -> bool:
    head, _, body = received.partition(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: (\d+)", head)
    return length is not None and len(body) >= int(length[1])


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


# The batcher --------------------------------------------------------------------------------------
def test_uploads_that_wait_together_share_one_network_run():
    with UploadClassifier(MODEL_DIR, providers="cpu", workers=1) as classifier:
        batcher = example.Batcher(classifier, batch=8, wait_ms=50)
        pixels = [classifier.preprocess(decoded_upload(path)) for path in SAMPLES[:5]]
        answers = [batcher.submit(row) for row in pixels]  # all waiting before the batcher starts
        batcher.start()
        got = np.stack([answer.result(timeout=60) for answer in answers])
        assert batcher.sizes == [5]
        expected = np.stack([answer.probabilities for answer in classifier.classify(
            [decoded_upload(path) for path in SAMPLES[:5]])])
        np.testing.assert_allclose(got, expected, atol=BATCH_TOLERANCE, rtol=0)


class StubClassifier:
    """The batcher's side of an UploadClassifier: a row of probabilities per upload, from a
    network that fails on the runs named in `failing`."""

    def __init__(self, failing: tuple[int, ...] = ()):
        self.failing, self.runs = failing, 0

    def probabilities(self, pixel_values: np.ndarray) -> np.ndarray:
        self.runs += 1
        if self.runs in self.failing:
            raise RuntimeError("CUDA failure: out of memory")
        return pixel_values.reshape(len(pixel_values), -1)[:, :2]


def test_a_network_run_takes_at_most_the_batch():
    batcher = example.Batcher(StubClassifier(), batch=4, wait_ms=50)
    answers = [batcher.submit(np.full((1, 1, 2, 2), index, np.float32)) for index in range(7)]
    batcher.start()
    assert [answer.result(timeout=60)[0] for answer in answers] == list(range(7))
    assert batcher.sizes == [4, 3]


def test_the_batcher_outlives_a_failed_run_and_a_cancelled_request():
    """The uploads of a run that fails hear why; a cancelled request (its client gone) is left
    out; the next uploads are answered."""
    batcher = example.Batcher(StubClassifier(failing=(1,)), batch=2, wait_ms=50)
    first = [batcher.submit(np.zeros((1, 1, 2, 2), np.float32)) for _ in range(2)]
    cancelled, kept = (batcher.submit(np.ones((1, 1, 2, 2), np.float32)) for _ in range(2))
    assert cancelled.cancel()
    batcher.start()
    for answer in first:
        with pytest.raises(example.NetworkFailed) as failed:
            answer.result(timeout=60)
        assert_one_line(str(failed.value), "on a batch of 2 (RuntimeError: CUDA failure: out of memory)")
    assert kept.result(timeout=60)[0] == 1 and batcher.sizes == [1]
    later = batcher.submit(np.full((1, 1, 2, 2), 2, np.float32))
    assert later.result(timeout=60)[0] == 2 and batcher.thread.is_alive()


@pytest.mark.parametrize("batch, wait_ms", [(0, 5), (4, float("inf")), (4, float("nan")), (4, -1)])
def test_the_batcher_refuses_what_would_stop_it(batch, wait_ms):
    with pytest.raises(example.UserError) as refused:
        example.Batcher(StubClassifier(), batch, wait_ms)
    assert_one_line(str(refused.value), "the batcher: expected")


# Requests -----------------------------------------------------------------------------------------
def test_a_large_jpeg_is_decoded_at_the_scale_the_model_needs(tmp_path):
    """The server's decode thread reads a 2400x1800 phone JPEG's bytes at 1200x900 (1/2 a side,
    keeping a digit model's 512 pixels on the shorter side), as gray levels, and preprocesses
    that, with the label of the full decode."""
    from conftest import digit_on_paper

    stored = tmp_path / "photo.jpg"
    digit_on_paper(SAMPLES[2], canvas=(2400, 1800), at=(700, 450), side=900).save(stored, quality=90)
    with UploadClassifier(MODEL_DIR, providers="cpu", workers=1) as classifier:
        seen, preprocess = [], classifier.preprocess
        classifier.preprocess = lambda image: seen.append(image.shape) or preprocess(image)
        reduced = example.prepared(classifier, stored.read_bytes())
        whole = preprocess(decoded_upload(stored))
        labels = [int(classifier.probabilities(pixels)[0].argmax()) for pixels in (reduced, whole)]
    assert seen == [(900, 1200, 1)]  # a digit model's gray levels (UploadClassifier.decode)
    assert labels == [int(SAMPLES[2].stem.split("_")[-1])] * 2


def test_concurrent_requests_get_the_routes_labels(server):
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda path: post(server, path.read_bytes()), SAMPLES))
    assert [status for status, _ in replies] == [200] * len(SAMPLES)
    assert [body["label"] for _, body in replies] == [path.stem.rsplit("_", 1)[1] for path in SAMPLES]
    assert max(server.batcher.sizes) <= 8


def test_a_refused_or_unreadable_upload_gets_its_reason(server, tmp_path):
    blank = tmp_path / "blank.png"
    Image.new("L", (60, 40), 225).save(blank)
    assert post(server, blank.read_bytes()) == (422, {"error": BLANK_IMAGE})
    status, body = post(server, b"not an image")
    assert status == 422 and assert_one_line(body["error"], "the upload is not a readable image")
    for name, data in MALFORMED.items():  # each was a traceback and no reply at all
        status, body = post(server, data)
        assert status == 422 and assert_one_line(body["error"], "the upload is not a readable image"), name
    assert post(server, DIGIT, "/other") == (404, {"error": "expected GET / or POST /classify, found POST /other"})


def test_a_get_says_where_each_part_runs(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("GET", "/")
    body = json.loads(connection.getresponse().read())
    assert body["providers"]["preprocessing"] == ["CPUExecutionProvider"] and body["labels"][7] == "7"


def test_a_burst_of_four_batches_is_answered_or_refused_with_503():
    """64 clients at once on a server of batches of 16 (at most 32 requests in): each one is
    answered with the digit's label or refused with 503 and Retry-After, none left waiting
    (the http.server example left up to 31 of 64 without an answer and reset others)."""
    with running(batch=16, wait_ms=5) as server:
        start = threading.Barrier(64)

        def client(_) -> tuple[int, dict, bytes]:
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            connection.connect()
            start.wait()
            try:
                connection.request("POST", "/classify", DIGIT)
                reply = connection.getresponse()
                return reply.status, dict(reply.getheaders()), reply.read()
            finally:
                connection.close()

        with ThreadPoolExecutor(64) as pool:
            replies = list(pool.map(client, range(64)))
    statuses = Counter(status for status, _, _ in replies)
    assert set(statuses) <= {200, 503} and statuses[200] >= 32, statuses
    for status, headers, body in replies:
        if status == 200:
            assert json.loads(body)["label"] == "7"
        else:
            assert headers["retry-after"] == "1"
            assert_one_line(json.loads(body)["error"], "the server is busy")


def test_a_body_over_the_limit_is_refused_from_the_stream(server):
    """Refused with 413 whether the body says its size (Content-Length) or not (chunked), at one
    byte over the limit; a body of exactly the limit is read (and is no image)."""
    limit = example.MAX_BODY_BYTES
    assert limit == 20 * 2**20
    status, body = post(server, bytes(limit + 1))
    assert status == 413 and assert_one_line(body["error"], f"at most {limit} bytes", f"Content-Length of {limit + 1}")
    chunked = b"".join(f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in [bytes(2**20)] * 20 + [b"x"])
    reply = raw(server.port, b"POST /classify HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                + chunked + b"0\r\n\r\n")
    assert status_of(reply) == 413 and b"found more" in reply
    status, body = post(server, bytes(limit))
    assert status == 422 and "not a readable image" in body["error"]


def test_malformed_http_gets_400_and_the_server_goes_on(server):
    for length in (b"abc", b"1e3", b"-1"):
        reply = raw(server.port, b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\n")
        assert status_of(reply) == 400, (length, reply)
    reply = raw(server.port, b"POST /classify HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
    assert status_of(reply) in (0, 400)  # a broken chunk: refused, or the connection closed
    status, body = post(server, b"", headers={"Content-Length": "0"})
    assert status == 400 and assert_one_line(body["error"], "found an empty body")
    assert post(server, DIGIT)[1]["label"] == "7"


def test_a_failed_network_run_is_500_for_its_requests_and_the_server_goes_on(server, monkeypatch):
    network = server.classifier.probabilities
    runs = []

    def failing_once(pixel_values: np.ndarray) -> np.ndarray:
        runs.append(len(pixel_values))
        if len(runs) == 1:
            raise RuntimeError("CUDA failure: out of memory")
        return network(pixel_values)

    monkeypatch.setattr(server.classifier, "probabilities", failing_once)
    status, body = post(server, DIGIT)
    assert status == 500 and assert_one_line(body["error"], "(RuntimeError: CUDA failure: out of memory)")
    assert post(server, DIGIT)[1]["label"] == "7" and len(runs) == 2


def test_a_client_gone_before_its_answer_leaves_no_traceback(server, capfd):
    """Four clients post a digit and reset their connections at once: the server writes their
    answers to nobody, without a word (the http.server example printed a BrokenPipe traceback)."""
    for _ in range(4):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(DIGIT) + DIGIT)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset, not a goodbye
        sock.close()
    time.sleep(1)  # their answers are written meanwhile
    assert post(server, DIGIT)[1]["label"] == "7"
    assert "Traceback" not in capfd.readouterr().err


def test_stalled_clients_get_408_and_hold_nobody_up(monkeypatch):
    """70 clients send their headers and no body: a new request is answered meanwhile (the
    http.server example spent a thread on each, and then could start none), and each stalled
    client gets 408 when its body is BODY_TIMEOUT_S late."""
    monkeypatch.setattr(example, "BODY_TIMEOUT_S", 2.0)
    with running(queue_limit=100) as server:
        stalled = [socket.create_connection(("127.0.0.1", server.port), timeout=60) for _ in range(70)]
        for sock in stalled:
            sock.sendall(b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
        assert post(server, DIGIT)[1]["label"] == "7"
        replies = [receive_until_closed(sock) for sock in stalled]
        for sock in stalled:
            sock.close()
    assert {status_of(reply) for reply in replies} == {408}
    assert b"expected the request's body within 2 s, found 0 bytes" in replies[0]


def test_a_full_server_refuses_with_503_until_a_place_frees(monkeypatch):
    monkeypatch.setattr(example, "BODY_TIMEOUT_S", 2.0)
    with running(queue_limit=2) as server:
        stalled = [socket.create_connection(("127.0.0.1", server.port), timeout=60) for _ in range(2)]
        for sock in stalled:
            sock.sendall(b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
        time.sleep(0.5)  # both admitted, waiting for their bodies
        status, headers, body = exchange(server.port, DIGIT)
        assert status == 503 and headers["retry-after"] == "1"
        assert_one_line(json.loads(body)["error"], "expected fewer than 2 requests in it, found 2")
        assert [status_of(receive_until_closed(sock)) for sock in stalled] == [408, 408]
        assert post(server, DIGIT)[1]["label"] == "7"


def test_a_connection_that_never_finishes_its_headers_is_closed(monkeypatch):
    monkeypatch.setattr(example, "HEADERS_TIMEOUT_S", 1.0)
    with running() as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as silent, \
                socket.create_connection(("127.0.0.1", server.port), timeout=60) as slow:
            slow.sendall(b"POST /classify HTTP/1.1\r\nHost: x\r\n")  # and never the rest
            assert silent.recv(1) == b"" and slow.recv(1) == b""  # closed by the server
        assert post(server, DIGIT)[1]["label"] == "7"


# The command line and the process -----------------------------------------------------------------
def run_example(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "examples/gpu_server.py", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("argv, fragment", [
    (["--wait-ms", "inf"], "argument --wait-ms: expected milliseconds from 0 to 60000, got 'inf'"),
    (["--wait-ms", "nan"], "got 'nan'"),
    (["--wait-ms", "-1"], "got '-1'"),
    (["--batch", "0"], "argument --batch: expected a whole number from 1 to 1024, got '0'"),
    (["--port", "99999"], "argument --port: expected a port from 0 to 65535, got '99999'"),
    (["--queue", "ten"], "argument --queue: expected a whole number"),
], ids=["inf wait", "nan wait", "negative wait", "batch 0", "port 99999", "queue not a number"])
def test_a_bad_flag_is_one_line_and_exit_2(argv, fragment):
    done = run_example("--model", str(MODEL_DIR), *argv)
    assert done.returncode == 2 and done.stdout == ""
    assert_one_line(done.stderr, "gpu_server.py: error: ", fragment)


def test_a_missing_model_or_a_port_in_use_is_one_line(tmp_path):
    done = run_example()
    assert done.returncode == 2
    assert_one_line(done.stderr, "gpu_server.py: error: --model: expected a model dir (with model.onnx), got none")
    done = run_example("--model", str(tmp_path / "nowhere"), "--port", "0")
    assert done.returncode == 2 and done.stderr.startswith("error: ")
    assert_one_line(done.stderr, str(tmp_path / "nowhere"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = run_example("--model", str(MODEL_DIR), "--port", str(taken.getsockname()[1]))
    assert done.returncode == 2
    assert_one_line(done.stderr, "expected an address to listen on, found it refused (Address already in use)")


def test_the_server_never_imports_torch():
    code = ("import runpy, sys; sys.argv = ['gpu_server.py']; example = runpy.run_path('examples/gpu_server.py'); "
            "example['Server']('models/vit-mnist', port=0); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.stdout.strip() == "False", done.stderr


def resident_mb(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())[1]) / 1024


@pytest.mark.slow
def test_memory_returns_to_idle_after_a_burst_of_16_megapixel_uploads(tmp_path):
    """A server process with two decode threads, warmed by one large upload; then three bursts
    of six PNGs of a few kilobytes that each decode to 15.9 megapixels (a dark bar on white,
    answered, and a blank 16-bit RGBA, decoded then refused: no ink). Resident memory ends
    within HELD_MB of idle (onnxruntime's CPU arena kept 760 MB, glibc's arenas 190 MB more)."""
    from bench.app_limits import SIDE, blank_png, digit_rgba

    bar = digit_rgba(tmp_path / "bar.png", SIDE).read_bytes()
    blank = blank_png(tmp_path / "blank.png", SIDE, SIDE, "16-bit RGBA").read_bytes()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "examples/gpu_server.py", "--model", str(MODEL_DIR), "--port", "0",
                                "--workers", "2"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        port = int(re.search(r":(\d+)/classify", process.stdout.readline())[1])
        assert exchange(port, bar, timeout=300)[0] == 200 and exchange(port, blank, timeout=300)[0] == 422
        time.sleep(1)
        idle = resident_mb(process.pid)
        held = []
        for _ in range(3):
            with ThreadPoolExecutor(6) as pool:
                statuses = list(pool.map(lambda body: exchange(port, body, timeout=300)[0], [bar, blank] * 3))
            assert statuses == [200, 422] * 3
            time.sleep(1)
            held.append(resident_mb(process.pid) - idle)
        assert max(held) < HELD_MB, (idle, held)
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    assert "Traceback" not in stderr, stderr
