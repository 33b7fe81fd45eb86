"""examples/gpu_server.py, as docs/export.md ("On a GPU server") runs it: concurrent requests
get the Python route's answers, the uploads that wait together share one network run, and a
refused or unreadable upload gets its reason (here on the CPU provider; a GPU runs the same code)."""

from __future__ import annotations

import importlib.util
import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vit_hub.export.batched_runtime import BATCH_TOLERANCE, UploadClassifier, decoded_upload
from vit_hub.processing.canonical import BLANK_IMAGE

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "vit-mnist"
SAMPLES = sorted((ROOT / "vit_hub" / "bundled" / "samples").glob("mnist_test_*_label_*.png"))


def load_example():
    spec = importlib.util.spec_from_file_location("gpu_server", ROOT / "examples" / "gpu_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = load_example()


@pytest.fixture(scope="module")
def server():
    running = example.serve(str(MODEL_DIR), port=0, batch=8, wait_ms=50)
    threading.Thread(target=running.serve_forever, daemon=True).start()
    yield running
    running.shutdown()


def post(server, data: bytes, path: str = "/classify") -> tuple[int, dict]:
    url = f"http://127.0.0.1:{server.server_address[1]}{path}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method="POST"), timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def test_uploads_that_wait_together_share_one_network_run():
    with UploadClassifier(MODEL_DIR, providers="cpu", workers=1) as classifier:
        batcher = example.Batcher(classifier, batch=8, wait_ms=50)
        pixels = [classifier.preprocess(decoded_upload(path)) for path in SAMPLES[:5]]
        answers = [batcher.submit(row) for row in pixels]  # all waiting before the batcher starts
        batcher.start()
        got = np.stack([answer.result(timeout=60) for answer in answers])
        assert batcher.runs == 1
        expected = np.stack([answer.probabilities for answer in classifier.classify(
            [decoded_upload(path) for path in SAMPLES[:5]])])
        np.testing.assert_allclose(got, expected, atol=BATCH_TOLERANCE, rtol=0)


def test_concurrent_requests_get_the_routes_labels(server):
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda path: post(server, path.read_bytes()), SAMPLES))
    assert [status for status, _ in replies] == [200] * len(SAMPLES)
    assert [body["label"] for _, body in replies] == [path.stem.rsplit("_", 1)[1] for path in SAMPLES]
    assert server.batcher.runs <= len(SAMPLES)


def test_a_refused_or_unreadable_upload_gets_its_reason(server, tmp_path):
    blank = tmp_path / "blank.png"
    Image.new("L", (60, 40), 225).save(blank)
    assert post(server, blank.read_bytes()) == (422, {"error": BLANK_IMAGE})
    status, body = post(server, b"not an image")
    assert status == 422 and "not a readable image" in body["error"]
    assert post(server, SAMPLES[0].read_bytes(), "/other")[0] == 404


def test_a_get_says_where_each_part_runs(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/", timeout=60) as reply:
        body = json.loads(reply.read())
    assert body["providers"]["preprocessing"] == ["CPUExecutionProvider"] and body["labels"][7] == "7"
