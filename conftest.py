"""Fixtures for the README's Python blocks, which pytest-markdown-docs collects from README.md
(`--markdown-docs` in pyproject.toml). They live here because tests/conftest.py does not reach
files outside tests/. A block names its fixtures in its info string (```python fixture:NAME).
The README's shell blocks are run by tests/test_readme.py.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent
README_APP_URL = "http://127.0.0.1:7860"  # the address the README's client block calls
README_DIGIT = REPO / "vit_hub" / "bundled" / "samples" / "mnist_test_0000_label_7.png"
HUB_TOKEN = "hf_vitHubReadmeToken0123456789abcdef"


def pytest_collection_modifyitems(items):
    """Every README block runs from the repo root, as a reader who followed the set-up would."""
    for item in items:
        if item.get_closest_marker("markdown-docs"):
            item.add_marker(pytest.mark.usefixtures("readme_cwd"))


@pytest.fixture
def readme_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def readme_app(readme_cwd, monkeypatch, tmp_path):
    """The app on the bundled model, served in this process on a free port (7860 may be taken
    by a reader's `make app`): the block's `Client("http://127.0.0.1:7860/")` is pointed there,
    and its `digit.png` is a bundled test digit in the working directory."""
    import gradio_client
    import torch

    from vit_hub.demo.backends import TorchPredictor
    from vit_hub.demo.page import build_demo, serve
    from vit_hub.demo.server import DEFAULT_MODEL

    threads = torch.get_num_threads()
    demo = build_demo(TorchPredictor.load(DEFAULT_MODEL))
    _, url, _ = serve(demo, port=_free_port(), prevent_thread_lock=True, quiet=True)
    calls = []

    class ServedClient(gradio_client.Client):
        def __init__(self, src: str, *args, **kwargs):
            if src.rstrip("/") != README_APP_URL:
                raise AssertionError(f"the README's client block calls {src}, expected {README_APP_URL}/")
            calls.append(src)
            super().__init__(url, *args, verbose=False, **kwargs)

    monkeypatch.setattr(gradio_client, "Client", ServedClient)
    shutil.copy(README_DIGIT, tmp_path / "digit.png")
    monkeypatch.chdir(tmp_path)
    yield
    demo.close()
    torch.set_num_threads(threads)
    assert calls, "the README's client block never called the app"


@pytest.fixture
def readme_hub(monkeypatch, tmp_path):
    """A local stand-in of the Hub's API (tests/hub_double.py) with a token in HF_TOKEN and a
    fresh cache: the README's Python Hub block pushes to it and loads from it, offline."""
    from tests.hub_double import serving_hub

    with serving_hub(monkeypatch, tmp_path / "hf-cache", HUB_TOKEN) as double:
        yield double
    assert len(double.commits) == 1 and "model_attentions.onnx" in double.commits[0].files
