"""The app gives memory back after requests it refuses, not only after those it answers.

A blank image (no ink) is decoded whole before it is found blank. A gr.Error raised inside the
except block would hold the EmptyImageError and its traceback, whose frames hold the decoded
arrays, and Gradio keeps the error a while (6 such refusals of a 9 MP 16-bit RGBA PNG held
+309 MB when raised that way); so the refusal is raised outside it. glibc's rising mmap
threshold would put later decoded images in its arenas, which fragment (uploads.map_large_blocks). Each test here is a
few seconds: small images, few requests, one server process whose resident memory is read
from /proc.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
from pathlib import Path

import gradio as gr
from test_untrusted_uploads import app_in_its_own_process, rss_mb

from bench.app_limits import blank_png
from conftest import BUNDLED_MODEL, call, file_data, free_port, upload
from vit_hub.demo import backends, page, uploads

ROOT = Path(__file__).resolve().parents[1]
CONTROLS = ("mean", 0.0, 3, "rollout")
HELD_MB = 100  # what a burst may leave behind


def resident_mb() -> int:
    return rss_mb(os.getpid())[0]


def test_a_refusal_keeps_none_of_the_request_s_arrays(tmp_path, monkeypatch):
    """In this process: the gr.Error a refused request raises, kept as Gradio keeps it, holds
    no decoded image (6 refusals of this image raised inside the except block held +309 MB)."""
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    from gradio.utils import get_upload_folder

    folder = Path(get_upload_folder())
    folder.mkdir(parents=True, exist_ok=True)
    blank = blank_png(folder / "blank.png", 3_000, 3_000, "16-bit RGBA")
    predict = uploads.user_errors(page.Handlers(backends.TorchPredictor.load(BUNDLED_MODEL), "rollout").predict)
    request = ({"path": str(blank), "orig_name": "blank.png"}, *CONTROLS)
    kept = []
    for _ in range(2):  # the first call warms up what every call shares
        try:
            predict(*request)
        except gr.Error as error:
            kept.append(error)
    gc.collect()
    idle = resident_mb()
    for _ in range(6):
        try:
            predict(*request)
        except gr.Error as error:
            kept.append(error)
    gc.collect()
    uploads.return_freed_memory()
    assert len(kept) == 8 and "found a blank image" in kept[-1].message
    assert kept[-1].__context__ is None and kept[-1].__cause__ is None
    assert resident_mb() - idle < HELD_MB / 2, (idle, resident_mb())


def test_a_burst_of_refused_and_answered_requests_gives_memory_back(tmp_path):
    """Against a server in its own process: 24 requests, 8 at a time, of a blank 9 MP 16-bit RGBA
    PNG (refused after it is decoded: no ink) and a digit (answered); resident memory ends within
    HELD_MB of where it stood after one request of each."""
    with app_in_its_own_process(GRADIO_TEMP_DIR=str(tmp_path / "gradio")) as (server, url):
        blank = blank_png(tmp_path / "blank.png", 3_000, 3_000, "16-bit RGBA")
        digit = ROOT / "vit_hub" / "bundled" / "samples" / "mnist_test_0000_label_7.png"  # a 7

        def request(index: int) -> str:
            path = digit if index % 4 == 0 else blank
            return call(url, "predict", [file_data(upload(url, path), orig_name=path.name), *CONTROLS])[0]

        assert [request(0), request(1)] == ["complete", "error"]  # warm
        idle, _ = rss_mb(server.pid)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            events = list(pool.map(request, range(24)))
        after, peak = rss_mb(server.pid)
    assert events.count("complete") == 6 and events.count("error") == 18, events
    assert after - idle < HELD_MB, (idle, peak, after)


def test_the_server_keeps_a_bounded_number_of_sessions(monkeypatch):
    """Every API call without a session is a new Gradio session holding a copy of the page's
    config (about 80 KB): at Gradio's default capacity of 10,000 a server grows 20 MB every 250
    requests (bench/app_limits.py --steady). The app keeps page.SESSIONS_KEPT, here made 2 so
    that 5 requests go past it."""
    assert page.SESSIONS_KEPT <= 1_000
    monkeypatch.setattr(page, "SESSIONS_KEPT", 2)
    demo = page.build_demo(backends.TorchPredictor.load(BUNDLED_MODEL))
    _, url, _ = page.serve(demo, port=free_port(), prevent_thread_lock=True, quiet=True)
    try:
        digit = ROOT / "vit_hub" / "bundled" / "samples" / "mnist_test_0000_label_7.png"
        for _ in range(5):
            assert call(url, "predict_labels", [file_data(upload(url, digit), orig_name=digit.name), 3])[0] == "complete"
        assert demo.state_holder.capacity == 2 and len(demo.state_holder.session_data) == 2
    finally:
        demo.close()
