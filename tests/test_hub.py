"""Push and pull, offline, against two local stand-ins for the Hugging Face Hub:

- pushes go to `HubDouble` (tests/hub_double.py), a test double of the Hub's upload API;
- pulls come from a real `olah` server (the Hub-compatible mirror on PyPI) serving git repos
  from a temporary folder, configured as DESIGN.md describes.

vit_hub's own functions read HF_ENDPOINT on every call, so most tests run in this process.
`HubVisionTransformer.from_pretrained("org/name")` goes through huggingface_hub, which reads
HF_ENDPOINT once at import: that check runs in a fresh Python process.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"  # before anything imports huggingface_hub

import contextlib
import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from hub_double import HubDouble
from huggingface_hub import ModelCard, constants
from PIL import Image

from conftest import free_port, tiny_config
from vit_hub.cli import main
from vit_hub.hub.card import is_generated_card, write_model_card
from vit_hub.hub.pretrained import HubVisionTransformer, load_model
from vit_hub.hub.repos import CARD_GENERATED, CARD_KEPT, CARD_LOCAL, HubError, pull, push_to_hub

TOKEN = "hf_vitHubTestToken0123456789abcdefXYZ"
REPO = "org/name"
TINY = tiny_config(image_size=8, in_channels=1, depth=1, labels=["cat", "dog", "owl"])
METRICS = {"final": {"split": "test", "accuracy": 0.8125, "loss": 0.52, "n": 16},
           "settings": {"data": "mnist", "command": "vit-hub train --data mnist --out tiny --epochs 1"}}
PUSHED = {"config.json", "model.safetensors", "README.md", "metrics.json", "curves.png", "confusion_matrix.png"}
ONNX_REPORT = "model_export_report.json"
PIXELS = torch.linspace(-1.0, 1.0, 2 * 8 * 8).reshape(2, 1, 8, 8)
OLAH_CLI = Path(sys.executable).with_name("olah-cli")
ROOT = Path(__file__).resolve().parents[1]


def make_model_dir(path: Path, seed: int = 0) -> Path:
    """A model dir as `vit-hub train` leaves it, plus a checkpoint that must never be uploaded."""
    torch.manual_seed(seed)
    model = HubVisionTransformer(**TINY)
    torch.nn.init.normal_(model.head.weight)  # the head starts at zero: make the logits tell models apart
    model.save_pretrained(path)
    (path / "metrics.json").write_text(json.dumps(METRICS))
    for name in ("curves.png", "confusion_matrix.png"):
        Image.new("RGB", (4, 4), "white").save(path / name)
    (path / "checkpoint.safetensors").write_bytes(b"resumable training state, stays local")
    write_model_card(path)
    return path


def logits_of(model: HubVisionTransformer) -> list:
    with torch.no_grad():
        return model(PIXELS).logits.tolist()


def assert_token_absent(texts: list[str], folders: list[Path]) -> None:
    for text in texts:
        assert TOKEN not in text
    for folder in folders:
        for path in Path(folder).rglob("*"):
            assert not path.is_file() or TOKEN.encode() not in path.read_bytes(), path


@contextlib.contextmanager
def one_line_error(pattern: str, kind: type[Exception] = HubError):
    with pytest.raises(kind, match=pattern) as caught:
        yield
    assert "\n" not in str(caught.value)


@pytest.fixture(autouse=True)
def no_real_hub(monkeypatch, tmp_path):
    """No real token, cache or endpoint leaks into a test; the default endpoint refuses connections."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")


@pytest.fixture
def hub(monkeypatch):
    with HubDouble(TOKEN) as double:
        monkeypatch.setenv("HF_ENDPOINT", double.url)
        yield double
    assert double.unexpected == []  # huggingface_hub called nothing the double does not know


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return make_model_dir(tmp_path / "tiny")


# Push, against the test double ------------------------------------------------------------
def test_push_commits_exactly_the_model_files_in_one_commit(hub, model_dir, monkeypatch, capsys, caplog):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    caplog.set_level(logging.DEBUG)
    assert main(["push", "--model", str(model_dir), "--repo-id", REPO, "--private"]) == 0

    [commit] = hub.commits
    assert set(commit.files) == PUSHED  # no checkpoint, no stray files
    for name in PUSHED - {"README.md"}:
        assert commit.files[name] == (model_dir / name).read_bytes()
    assert hub.repos[REPO].private
    output = capsys.readouterr()
    assert f"model card: {CARD_GENERATED}" in output.out
    assert_token_absent([output.out, output.err, caplog.text, *hub.requests, *hub.validated_cards],
                        [model_dir, Path(constants.HF_HUB_CACHE)])
    assert all(TOKEN.encode() not in content for content in commit.files.values())


def test_push_dry_run_lists_the_files_and_reaches_no_hub(hub, model_dir, capsys):
    """No token, no request: the checks of a push, then the files it would upload."""
    (model_dir / "model.onnx").write_bytes(b"an ONNX graph")
    assert main(["push", "--model", str(model_dir), "--repo-id", REPO, "--with-onnx", "--dry-run"]) == 0
    assert hub.requests == [] and hub.commits == []
    printed = capsys.readouterr().out
    listed = printed.splitlines()[0].removeprefix("would push ").rpartition(" to ")[0].split(", ")
    assert set(listed) == PUSHED | {"model.onnx"} and f"to {REPO}@main" in printed and "--dry-run" in printed
    (model_dir / "config.json").unlink()
    assert main(["push", "--model", str(model_dir), "--repo-id", REPO, "--dry-run"]) == 2  # checked as a push is


def test_pushed_card_has_parsable_metadata_and_names_the_repo(hub, model_dir):
    push_to_hub(model_dir, REPO, token=TOKEN)
    text = hub.files(REPO)["README.md"].decode()

    front_matter = yaml.safe_load(text.split("---")[1])
    assert front_matter["library_name"] == "vit_hub"
    assert front_matter["pipeline_tag"] == "image-classification"
    assert front_matter["license"] == "mit" and "vit_hub" in front_matter["tags"]
    assert front_matter["datasets"] == ["ylecun/mnist"]
    [result] = ModelCard(text).data.eval_results
    assert (result.metric_type, result.metric_value, result.dataset_split) == ("accuracy", 0.8125, "test")
    assert is_generated_card(text)
    for needle in (f'from_pretrained("{REPO}")', f"--model {REPO}", METRICS["settings"]["command"],
                   "## Architecture", "![training curves](curves.png)", "OnnxClassifier", "app.py"):
        assert needle in text
    assert hub.validated_cards == [text]


@pytest.mark.parametrize("with_onnx", [True, False])
def test_with_onnx_adds_model_onnx_and_its_report(hub, model_dir, with_onnx):
    (model_dir / "model.onnx").write_bytes(b"an ONNX graph")
    (model_dir / ONNX_REPORT).write_text('{"max_abs_diff": 0.0}')
    result = push_to_hub(model_dir, REPO, token=TOKEN, with_onnx=with_onnx)

    expected = PUSHED | ({"model.onnx", ONNX_REPORT} if with_onnx else set())
    assert set(hub.commits[0].files) == set(result.files) == expected
    card = hub.files(REPO)["README.md"].decode()
    assert (f'hf_hub_download("{REPO}", "model.onnx")' in card) == with_onnx
    assert (f"python -m vit_hub.export --model {REPO}" in card) == (not with_onnx)


def test_with_onnx_without_model_onnx_names_the_export_command(hub, model_dir):
    from vit_hub.export import export_onnx

    with pytest.raises(HubError, match=r"^--with-onnx: expected model.onnx in .*vit-hub export --model"):
        push_to_hub(model_dir, REPO, token=TOKEN, with_onnx=True)
    assert hub.commits == []
    export_onnx(model_dir, model_dir, output_attentions=True)
    result = push_to_hub(model_dir, REPO, token=TOKEN, with_onnx=True)
    assert set(result.files) == PUSHED | {"model.onnx", "model_attentions.onnx", "pipeline.onnx",
                                          "pipeline_map.onnx", "pipeline_explain.onnx", "preprocess.onnx", ONNX_REPORT}
    for graph in ("model.onnx", "pipeline.onnx", "preprocess.onnx"):  # the last two: for apps in other languages
        assert hub.files(REPO)[graph] == (model_dir / graph).read_bytes()
    report = json.loads(hub.files(REPO)[ONNX_REPORT])["graphs"]
    assert report["model.onnx"] and report["model_attentions.onnx"]


def test_a_card_edited_on_the_hub_is_kept_unless_overwrite_card(hub, model_dir, capsys):
    push_to_hub(model_dir, REPO, token=TOKEN)
    edited = hub.files(REPO)["README.md"].replace(b"## Training", b"A note from the author.\n\n## Training")
    hub.put_file(REPO, "README.md", edited)

    assert main(["push", "--model", str(model_dir), "--repo-id", REPO, "--token", TOKEN]) == 0
    assert "README.md" not in hub.commits[-1].files
    assert hub.files(REPO)["README.md"] == edited
    output = capsys.readouterr()
    assert f"model card: {CARD_KEPT}" in output.out
    assert_token_absent([output.out, output.err], [model_dir])  # given with --token this time

    result = push_to_hub(model_dir, REPO, token=TOKEN, overwrite_card=True)
    assert result.card == CARD_GENERATED and "README.md" in hub.commits[-1].files
    assert is_generated_card(hub.files(REPO)["README.md"].decode())


def test_an_unedited_card_on_the_hub_is_regenerated(hub, model_dir):
    push_to_hub(model_dir, REPO, token=TOKEN)
    metrics = dict(METRICS, final=dict(METRICS["final"], accuracy=0.9375))
    (model_dir / "metrics.json").write_text(json.dumps(metrics))  # trained further
    write_model_card(model_dir)
    result = push_to_hub(model_dir, REPO, token=TOKEN)
    assert result.card == CARD_GENERATED
    assert "test accuracy: 0.9375" in hub.files(REPO)["README.md"].decode()


def test_a_card_edited_in_the_model_dir_goes_up_as_written(hub, model_dir):
    card = model_dir / "README.md"
    card.write_text(card.read_text().replace("## Training", "Trained on my own digits.\n\n## Training"))
    result = push_to_hub(model_dir, REPO, token=TOKEN)
    assert result.card == CARD_LOCAL
    assert hub.files(REPO)["README.md"] == card.read_bytes()


def test_push_to_a_branch_creates_it_and_leaves_main_alone(hub, model_dir):
    push_to_hub(model_dir, REPO, token=TOKEN)
    main_files = dict(hub.files(REPO))
    (model_dir / "metrics.json").write_text("{}")
    result = push_to_hub(model_dir, REPO, token=TOKEN, revision="experiment", commit_message="Try a new recipe")

    assert (result.revision, hub.commits[-1].branch, hub.commits[-1].summary) == (
        "experiment", "experiment", "Try a new recipe")
    assert hub.files(REPO) == main_files
    assert hub.files(REPO, "experiment")["metrics.json"] == b"{}"
    assert load_model(REPO, revision="experiment").config.labels == TINY["labels"]


def test_a_private_repo_loads_with_a_token_only(hub, model_dir, tmp_path):
    push_to_hub(model_dir, REPO, token=TOKEN, private=True)
    with one_line_error(r"no model repo org/name on .*a private repo needs a token"):
        load_model(REPO)
    assert logits_of(load_model(REPO, token=TOKEN)) == logits_of(load_model(model_dir))
    assert main(["pull", REPO, "--out", str(tmp_path / "pulled"), "--token", TOKEN]) == 0
    assert (tmp_path / "pulled" / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_push_errors_are_one_clear_line(hub, model_dir, tmp_path, monkeypatch):
    with one_line_error(r"push needs a Hugging Face token .*HF_TOKEN"):
        push_to_hub(model_dir, REPO)
    assert hub.requests == []  # nothing was sent without a token
    with one_line_error(r"refused the request for org/name: 401 .*write access"):
        push_to_hub(model_dir, REPO, token="hf_wrong")
    with one_line_error(r"--repo-id: expected OWNER/NAME, got 'name'"):
        push_to_hub(model_dir, "name", token=TOKEN)

    not_ours = tmp_path / "bert"
    not_ours.mkdir()
    (not_ours / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": 768}))
    (not_ours / "model.safetensors").write_bytes(b"")
    with one_line_error(r"bert is not a vit_hub model"):
        push_to_hub(not_ours, REPO, token=TOKEN)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with one_line_error(r"HF_HUB_OFFLINE is set, and this needs the Hub"):
        push_to_hub(model_dir, REPO, token=TOKEN)
    assert hub.commits == []


def test_push_with_the_network_down_says_so(model_dir):
    with one_line_error(r"cannot reach the Hub at http://127\.0\.0\.1:\d+ \(ConnectError\)"):
        push_to_hub(model_dir, REPO, token=TOKEN)


def test_an_unreachable_hub_is_one_line_at_once_without_retry_warnings(tmp_path, capsys, caplog, monkeypatch):
    """huggingface_hub alone retries an unreachable Hub, sleeping between tries and logging two
    warnings a try. Counted rather than timed (a shared machine's clock proves nothing): one
    connection attempt, the reachability check, and no sleep."""
    slept, connections = [], []
    monkeypatch.setattr(time, "sleep", slept.append)  # a retry loop's back-off, recorded and skipped
    connect = socket.create_connection  # what the check and httpx's transport open connections with

    def counted(address, *args, **kwargs):
        connections.append(address)
        return connect(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", counted)
    with caplog.at_level(logging.WARNING):
        assert main(["pull", REPO, "--out", str(tmp_path / "out")]) == 2
    assert slept == [] and len(connections) == 1, (slept, connections)
    error = capsys.readouterr().err
    assert error.startswith("error: cannot reach the Hub at http://127.0.0.1:") and error.count("\n") == 1, error
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING] == []


def test_from_pretrained_and_the_python_token_error_are_one_line(hub, model_dir, monkeypatch):
    push_to_hub(model_dir, REPO, token=TOKEN)
    assert logits_of(HubVisionTransformer.from_pretrained(REPO)) == logits_of(load_model(model_dir))
    with one_line_error(r"no model repo org/absent on http://"):
        HubVisionTransformer.from_pretrained("org/absent")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with one_line_error(r"HF_HUB_OFFLINE is set and org/other@main is not in the local cache"):
        HubVisionTransformer.from_pretrained("org/other")
    with one_line_error(r"push needs a Hugging Face token .*token= in Python"):
        push_to_hub(model_dir, REPO)


def test_loading_errors_are_one_clear_line(hub, model_dir):
    push_to_hub(model_dir, REPO, token=TOKEN)
    hub.put_file(REPO, "config.json", json.dumps({"model_type": "bert", "hidden_size": 768}).encode())
    with one_line_error(r"org/name is not a vit_hub model: .*not a vit_hub config"):
        load_model(REPO)
    with one_line_error(r"org/name on http://\S+ has no revision 'v9'"):
        load_model(REPO, revision="v9")
    with one_line_error(r"--model: no model folder at \./missing/model", FileNotFoundError):
        load_model("./missing/model")


@pytest.mark.parametrize("argv, message", [
    (["push", "--model", "{model_dir}", "--repo-id", REPO], "push needs a Hugging Face token"),
    (["push", "--model", "{model_dir}", "--repo-id", REPO, "--token", "hf_wrong"], "the Hub at http://"),
    (["pull", "org/absent", "--out", "{tmp_path}/out"], "no model repo org/absent on http://"),
    (["predict", "--model", "org/absent", "x.png"],
     "--model org/absent: no such folder here, and as a Hub repo: no model repo org/absent on http://"),
])
def test_cli_prints_hub_errors_as_one_line(hub, argv, message, model_dir, tmp_path, capsys):
    assert main([arg.format(model_dir=model_dir, tmp_path=tmp_path) for arg in argv]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {message}") and error.count("\n") == 1, error


# Pull, against a real olah server -----------------------------------------------------------
class Olah:
    """olah-cli serving git repos under `mirrors/models/<org>/<name>` as a Hub endpoint."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.mirrors = root / "mirrors"
        (root / "repos").mkdir(parents=True)
        (root / "olah.toml").write_text(
            f'[basic]\nhost = "127.0.0.1"\nport = {self.port}\nrepos-path = "{root / "repos"}"\n'
            f'mirrors-path = ["{self.mirrors}"]\nmirror-scheme = "http"\n'
            f'mirror-netloc = "127.0.0.1:{self.port}"\nmirror-lfs-netloc = "127.0.0.1:{self.port}"\n\n'
            "[accessibility]\noffline = true\n")

    def start(self) -> subprocess.Popen:
        log = (self.root / "olah.log").open("w")
        process = subprocess.Popen([str(OLAH_CLI), "-c", "olah.toml"], cwd=self.root, stdout=log,
                                   stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return process
            time.sleep(0.2)
        process.kill()
        raise RuntimeError(f"olah did not start: {(self.root / 'olah.log').read_text()[-2000:]}")

    def add_repo(self, repo_id: str, files: dict[str, bytes]) -> None:
        """A git repo holding `files` in one commit on main, as a Hub repo would."""
        folder = self.mirrors / "models" / repo_id
        folder.mkdir(parents=True)
        for name, content in files.items():
            (folder / name).write_bytes(content)
        git = ["git", "-c", "user.name=vit_hub tests", "-c", "user.email=tests@vit-hub.invalid"]
        for command in (["init", "-q", "-b", "main"], ["add", "."], ["commit", "-q", "-m", "model"]):
            subprocess.run(git + command, cwd=folder, check=True)


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("source") / "tiny", seed=1)


@pytest.fixture(scope="module")
def olah(tmp_path_factory, source_dir):
    """A running olah with `org/name` (the source dir's files) and `org/bert` (not ours)."""
    assert OLAH_CLI.exists(), "olah is not installed (requirements-dev.txt)"
    server = Olah(tmp_path_factory.mktemp("olah"))
    server.add_repo(REPO, {name: (source_dir / name).read_bytes() for name in PUSHED})
    server.add_repo("org/bert", {"config.json": b'{"model_type": "bert"}', "model.safetensors": b"\0" * 64})
    process = server.start()
    yield server
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()


def test_load_model_and_pull_from_olah_give_the_source_logits(olah, source_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", olah.url)
    expected = logits_of(load_model(source_dir))
    assert logits_of(load_model(REPO)) == expected

    assert main(["pull", REPO, "--out", str(tmp_path / "pulled")]) == 0
    for name in PUSHED:
        assert (tmp_path / "pulled" / name).read_bytes() == (source_dir / name).read_bytes()
    assert logits_of(load_model(tmp_path / "pulled")) == expected


def test_offline_serves_the_cache_and_names_what_is_missing(olah, source_dir, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", olah.url)
    load_model(REPO)  # online once: now cached
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    assert logits_of(load_model(REPO)) == logits_of(load_model(source_dir))
    with one_line_error(r"HF_HUB_OFFLINE is set and org/other@main is not in the local cache"):
        load_model("org/other")
    with one_line_error(r"HF_HUB_OFFLINE is set and org/other@main is not in the local cache"):
        pull("org/other", Path(constants.HF_HUB_CACHE) / "out")


def test_olah_errors_unknown_repo_not_ours_network_down(olah, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", olah.url)
    with one_line_error(rf"no model repo org/absent on {olah.url} \(check the id"):
        load_model("org/absent")
    with one_line_error(r"org/bert is not a vit_hub model"):
        pull("org/bert", tmp_path / "bert")
    assert not list(Path(constants.HF_HUB_CACHE).rglob("model.safetensors"))  # failed before the weights
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    # huggingface_hub retries a failed download several times with back-off: skip the waits.
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    with one_line_error(r"cannot reach the Hub at .* org/name@main is not in the local cache"):
        load_model(REPO)


# Run with the repo root as the working directory; argv: out folder, source dir, repo ids.
FRESH_PROCESS = """
import json, pathlib, sys, torch
from vit_hub.cli import main
from vit_hub.hub.pretrained import HubVisionTransformer, load_model
out, source, repo_ids = sys.argv[1], sys.argv[2], sys.argv[3:]
pixels = torch.linspace(-1.0, 1.0, 2 * 8 * 8).reshape(2, 1, 8, 8)
results = {}
with torch.no_grad():
    for repo_id in repo_ids:
        assert main(["pull", repo_id, "--out", f"{out}/{repo_id}"]) == 0
        results[repo_id] = {"from_pretrained": HubVisionTransformer.from_pretrained(repo_id)(pixels).logits.tolist(),
                            "pulled": load_model(f"{out}/{repo_id}")(pixels).logits.tolist()}
if pathlib.Path("app.py").is_file():  # the Gradio app's loader, as `python app.py --model OWNER/NAME` uses it
    from vit_hub.demo.backends import load_predictor
    expected = load_predictor(source, "torch").predict(pixels.numpy())[0]
    for repo_id in repo_ids:
        results[repo_id]["app_matches"] = bool((load_predictor(repo_id, "torch").predict(pixels.numpy())[0]
                                                == expected).all())
print(json.dumps(results))
"""


def test_round_trip_push_mirror_pull_in_a_fresh_process(olah, source_dir, monkeypatch, tmp_path):
    """Push to the double, commit what it received into an olah mirror, then load that and
    `org/name` in a new Python process that only knows HF_ENDPOINT: `from_pretrained`,
    `vit-hub pull` and the app's loader (once app.py exists) all match the source dir."""
    with HubDouble(TOKEN) as double:
        monkeypatch.setenv("HF_ENDPOINT", double.url)
        push_to_hub(source_dir, "org/round-trip", token=TOKEN)
    olah.add_repo("org/round-trip", double.files("org/round-trip"))

    environment = {**os.environ, "HF_ENDPOINT": olah.url, "HF_HOME": str(tmp_path / "hf-home"),
                   "HF_HUB_CACHE": str(tmp_path / "hf-home" / "hub"), "HF_HUB_DISABLE_TELEMETRY": "1",
                   "GRADIO_ANALYTICS_ENABLED": "False"}
    command = [sys.executable, "-c", FRESH_PROCESS, str(tmp_path / "pulled"), str(source_dir), REPO, "org/round-trip"]
    done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])

    expected = logits_of(load_model(source_dir))
    app = {"app_matches": True} if (ROOT / "app.py").is_file() else {}
    for repo_id in (REPO, "org/round-trip"):
        assert results[repo_id] == {"from_pretrained": expected, "pulled": expected, **app}


def test_the_bundled_models_card_is_the_one_card_py_writes(monkeypatch):
    """models/vit-mnist/README.md is a sealed vit_hub card, as rendered from its folder today (its
    snippets name the folder as the README does, from the checkout): an edit by hand, or a rename
    done with sed, breaks the seal, and a push would then upload it as a hand-written card
    instead of regenerating it for the repo."""
    from vit_hub.hub.card import render_card_text

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    bundled = Path("models") / "vit-mnist"
    text = (bundled / "README.md").read_text()
    assert is_generated_card(text)
    assert text == render_card_text(bundled)
