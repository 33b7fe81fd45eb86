"""End-to-end latency of the app's endpoints through gradio_client.

For each backend: start `python app.py` in its own process on 127.0.0.1, send warm-up
requests, then N requests (the bundled sample digits in turn) to /explain, the page's
endpoint, from `--concurrency` client threads, each with its own gradio_client.Client. A
request's time covers uploading the image, queueing, preprocessing, the forward pass with
attentions, the map, rendering the four pictures and downloading them.

More numbers put it in context, measured in this process without Gradio: the forward
pass with attentions plus the map, and everything the /explain handler does (read the
file, preprocess, forward, map, draw the pictures); and a Gradio floor: an endpoint that
only echoes a string, served with the same launch settings and called the same way.

    python bench/app_latency.py [--model models/vit-mnist] [--backends torch onnx]
                                [--requests 200] [--concurrency 4]

With --versus-bare: the app's named endpoints against a bare Gradio app that takes /predict's
inputs with the same launch settings and answers a constant label, both serving at once and
called in turn (one call of each per round, the order rotating), one client each, so that a
machine shared with other jobs slows all of them alike. Reported: each one's p50 over
--calls rounds and its ratio to the bare app's p50: /predict (labels and the map as
numbers), /predict_labels, and /explain as gradio_client calls it by default (its four
pictures downloaded, each with a new HTTP client, which loads the CA certificates again),
with download_files=False (the pictures stay on the server, their URLs come back), and
with the four pictures then fetched over one HTTP client.

    python bench/app_latency.py --versus-bare [--backends torch] [--calls 40]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

from gradio_client import Client, handle_file  # noqa: E402

from vit_hub.demo import backends, methods, pictures, uploads  # noqa: E402
from vit_hub.demo.server import DEFAULT_MODEL  # noqa: E402
from vit_hub.explain.rollout import layer_rollouts  # noqa: E402
from vit_hub.processing.preprocess import model_pixels, to_model_domain  # noqa: E402

# The floor: the app's launch settings around an endpoint that does nothing.
ECHO_SERVER = """
import sys, gradio as gr
from vit_hub.demo import page
with gr.Blocks(analytics_enabled=False) as demo:
    text = gr.Textbox()
    gr.Button().click(lambda value: value, text, text, api_name="echo")
page.serve(demo, port=int(sys.argv[1]))
"""

# The floor of /predict: the app's inputs and launch settings around a constant answer.
BARE_SERVER = """
import sys, gradio as gr
from vit_hub.explain.attribution import METHODS
from vit_hub.demo import methods, page
from vit_hub.explain.rollout import HEAD_FUSIONS
with gr.Blocks(analytics_enabled=False) as demo:
    image = gr.Image(type="filepath")
    controls = [gr.Radio(list(HEAD_FUSIONS), value="mean"), gr.Slider(0.0, 0.95, value=0.0),
                gr.Slider(1, 10, value=3, step=1), gr.Dropdown(list(METHODS), value=methods.DEFAULT_METHOD)]
    label = gr.Label()
    gr.Button().click(lambda *inputs: {"7": 1.0}, [image, *controls], label, api_name="predict", preprocess=False)
page.serve(demo, port=int(sys.argv[1]))
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--backends", nargs="+", default=["torch", "onnx"], choices=["torch", "onnx"])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--handler-only", action="store_true",
                        help="only the in-process handler time of every explanation method the backend offers "
                             "(no server; one thread), to pick the app's default method")
    parser.add_argument("--rounds", type=int, default=200, help="handler calls per measurement")
    parser.add_argument("--versus-bare", action="store_true",
                        help="the app's endpoints against a bare Gradio app with the same inputs, interleaved")
    parser.add_argument("--calls", type=int, default=40, help="rounds of --versus-bare (one call of each per round)")
    parser.add_argument("--samples", type=Path, default=ROOT / "vit_hub" / "bundled" / "samples",
                        help="folder of images to send (default: the bundled MNIST samples)")
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(command: list[str], port: int, timeout: float = 300.0) -> subprocess.Popen:
    """Run a server command and wait until gradio_client can connect to it."""
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=dict(os.environ, GRADIO_ANALYTICS_ENABLED="False"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{' '.join(command)} exited with code {server.returncode}")
        try:
            Client(f"http://127.0.0.1:{port}/", verbose=False)
            return server
        except Exception:  # not listening yet
            time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"{' '.join(command)} did not start within {timeout:.0f} s")


def run_requests(url: str, call: Callable[[Client, int], Any], count: int,
                 concurrency: int) -> tuple[list[float], list[str]]:
    """`count` calls of call(client, index) from `concurrency` threads, each thread with its
    own Client -> (latencies in s, error messages)."""
    clients = [Client(url, verbose=False) for _ in range(concurrency)]

    def one(index: int) -> tuple[float | None, str | None]:
        start = time.perf_counter()
        try:
            call(clients[index % concurrency], index)
        except Exception as error:  # a failed request is a result to count, not a crash
            return None, f"{type(error).__name__}: {error}"
        return time.perf_counter() - start, None

    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(count)))
    return [t for t, _ in results if t is not None], [e for _, e in results if e is not None]


def measure(command: list[str], call: Callable[[Client, int], Any], args: argparse.Namespace) -> dict:
    """Start the server, warm up, time args.requests calls, stop it."""
    port = free_port()
    server = start_server([*command, str(port)], port)  # both commands take the port last
    url = f"http://127.0.0.1:{port}/"
    try:
        run_requests(url, call, args.warmup, args.concurrency)
        start = time.perf_counter()
        latencies, errors = run_requests(url, call, args.requests, args.concurrency)
        wall = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=30)
    ms = 1000 * np.asarray(latencies) if latencies else np.asarray([np.nan])
    return dict(p50=np.percentile(ms, 50), p95=np.percentile(ms, 95), throughput=len(latencies) / wall,
                failures=len(errors), first_error=errors[0] if errors else "")


def handler_ms(predictor: backends.Predictor, samples: list[Path], rounds: int = 200,
               method: str = "rollout") -> tuple[float, float]:
    """Median in-process times of (forward pass with attentions + the method's map, everything
    the /explain handler does: read the file, preprocess, forward, the map, the rollout strip,
    the head maps, every image)."""
    return tuple(1000 * float(np.median(times)) for times in handler_times(predictor, samples, rounds, method)[:2])


def handler_times(predictor: backends.Predictor, samples: list[Path], rounds: int,
                  method: str, clock: Callable[[], float] = time.perf_counter) -> tuple[list[float], list[float]]:
    """(forward + map, whole handler) times of `rounds` calls, by `clock`: wall time, or
    time.process_time for the CPU time this process spent (what the calls cost on a machine
    that other jobs share)."""
    model_times, whole_times = [], []
    for index in range(rounds):
        start = clock()
        view = to_model_domain(uploads.read_upload(str(samples[index % len(samples)])), predictor.config)
        pixels = model_pixels(view, predictor.config)[None]
        forward = clock()
        if method == "rollout":
            _, attentions = predictor.predict(pixels)
            layer_rollouts(attentions, "mean", 0.0, predictor.config.grid_size, predictor.config.pooling)
        else:
            predictor.explain(pixels, method)
        model_times.append(clock() - forward)
        pictures.explain(predictor, view, "mean", 0.0, 3, method)
        whole_times.append(clock() - start - model_times[-1])
    return model_times, whole_times


def as_uploads(paths: list[Path]) -> list[Path]:
    """Copies in Gradio's upload folder: the handler opens nothing else (uploads.uploaded_file)."""
    import shutil

    from gradio.utils import get_upload_folder

    folder = Path(get_upload_folder()) / "bench_app_latency"
    folder.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy(path, folder / f"{index:03d}{path.suffix}")) for index, path in enumerate(paths)]


def handler_table(args: argparse.Namespace, samples: list[Path]) -> None:
    """The handler time of every method each backend offers: what picks methods.DEFAULT_METHOD."""
    print(f"in-process /explain handler, model {args.model}, median of {args.rounds} calls, one thread; "
          f"wall time and this process's CPU time")
    print("| backend | method | forward + map ms | whole handler ms | forward + map CPU ms | whole handler CPU ms |\n"
          "|---|---|---|---|---|---|")
    for backend in args.backends:
        predictor = backends.load_predictor(args.model, backend)
        for method in predictor.methods:
            handler_ms(predictor, samples, 5, method)  # warm-up
            wall = [1000 * float(np.median(t)) for t in handler_times(predictor, samples, args.rounds, method)]
            cpu = [1000 * float(np.median(t)) for t in handler_times(predictor, samples, args.rounds, method,
                                                                       time.process_time)]
            print(f"| {predictor.description} | {method} | {wall[0]:.2f} | {wall[1]:.2f} | {cpu[0]:.2f} | "
                  f"{cpu[1]:.2f} |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores); {time.strftime('%Y-%m-%d %H:%M')}; "
          f"command: python {' '.join(sys.argv)}")


def bench_backend(model: str, backend: str, args: argparse.Namespace, samples: list[Path]) -> dict:
    predictor = backends.load_predictor(model, backend)

    def classify(client: Client, index: int) -> None:
        scores, *_ = client.predict(handle_file(str(samples[index % len(samples)])), "mean", 0.0, 3,
                                    methods.DEFAULT_METHOD if backend == "torch" else methods.ONNX_DEFAULT_METHOD,
                                    api_name="/explain")
        if not scores.get("label"):
            raise ValueError(f"no label in {scores}")

    command = [sys.executable, "app.py", "--model", model, "--backend", backend, "--port"]
    row = measure(command, classify, args)
    model, handler = handler_ms(predictor, samples, method=methods.DEFAULT_METHOD if backend == "torch"
                                else methods.ONNX_DEFAULT_METHOD)
    return dict(row, name=f"/explain, {predictor.description}", model=f"{model:.2f}", handler=f"{handler:.2f}")


def versus_bare(args: argparse.Namespace, samples: list[Path], backend: str) -> None:
    """The app's endpoints and the bare app's, served at once and called in turn (see the docstring)."""
    app_port, bare_port = free_port(), free_port()
    servers = [start_server([sys.executable, "app.py", "--model", args.model, "--backend", backend, "--port",
                             str(app_port)], app_port),
               start_server([sys.executable, "-c", BARE_SERVER, str(bare_port)], bare_port)]
    app_url, bare_url = f"http://127.0.0.1:{app_port}/", f"http://127.0.0.1:{bare_port}/"

    def predict(client: Client, sample: Path) -> Any:  # the caller leaves the method to the app
        return client.predict(handle_file(str(sample)), "mean", 0.0, 3, api_name="/predict")

    def explain(client: Client, sample: Path) -> Any:
        return client.predict(handle_file(str(sample)), "mean", 0.0, 3, api_name="/explain")

    def predict_labels(client: Client, sample: Path) -> Any:
        return client.predict(handle_file(str(sample)), 3, api_name="/predict_labels")

    http = httpx.Client()  # one connection for every picture: what gradio_client's downloads lack

    def explain_then_fetch(client: Client, sample: Path) -> Any:
        result = explain(client, sample)
        for picture in result[1:]:
            http.get(picture["url"]).raise_for_status()
        return result

    calls = {  # name -> (client, call)
        "/predict: labels and the map as numbers": (Client(app_url, verbose=False), predict),
        "/predict_labels": (Client(app_url, verbose=False), predict_labels),
        "/explain, pictures downloaded (gradio_client's default)": (Client(app_url, verbose=False), explain),
        "/explain, download_files=False": (Client(app_url, verbose=False, download_files=False), explain),
        "/explain, download_files=False, the pictures fetched with one httpx.Client":
            (Client(app_url, verbose=False, download_files=False), explain_then_fetch),
        "bare app: same inputs, constant label": (Client(bare_url, verbose=False), predict),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    load_before = os.getloadavg()[0]
    try:
        for round_index in range(args.warmup + args.calls):
            names = list(calls)
            names = names[round_index % len(names):] + names[:round_index % len(names)]  # rotate the order
            for name in names:
                client, call = calls[name]
                start = time.perf_counter()
                result = call(client, samples[round_index % len(samples)])
                if round_index >= args.warmup:
                    times[name].append(1000 * (time.perf_counter() - start))
                scores = result[0] if isinstance(result, tuple) else result
                if not scores.get("label"):
                    raise ValueError(f"{name}: no label in {scores}")
    finally:
        http.close()
        for server in servers:
            server.terminate()
            server.wait(timeout=30)
    floor = float(np.median(times["bare app: same inputs, constant label"]))
    print(f"model {args.model}, backend {backend}; p50 of {args.calls} calls each, interleaved, one gradio_client "
          f"per row, servers in their own processes")
    print("| call | p50 ms | x bare p50 |\n|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {np.median(values):.1f} | {np.median(values) / floor:.2f} |")
    print(f"\nload average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} cores); "
          f"{time.strftime('%Y-%m-%d %H:%M')}; command: python {' '.join(sys.argv)}")


def main() -> None:
    args = parse_args()
    samples = as_uploads(sorted(path for path in args.samples.rglob("*") if path.suffix in (".png", ".jpg"))[:20])
    if args.handler_only:
        handler_table(args, samples)
        return
    if args.versus_bare:
        for backend in args.backends:
            versus_bare(args, samples, backend)
        return
    load_before = os.getloadavg()[0]
    floor = measure([sys.executable, "-c", ECHO_SERVER], lambda client, i: client.predict(str(i), api_name="/echo"),
                    args)
    rows = [dict(floor, name="Gradio floor: /echo of a string", model="-", handler="-")]
    with tempfile.TemporaryDirectory() as onnx_dir:
        for backend in args.backends:
            model = args.model
            if backend == "onnx":  # export once here, so the server and this process share it
                from vit_hub.export import export_onnx

                export_onnx(args.model, onnx_dir, output_attentions=True)
                model = onnx_dir
            rows.append(bench_backend(model, backend, args, samples))
    print(f"{args.requests} requests at concurrency {args.concurrency} through gradio_client, "
          f"model {args.model}, server in its own process")
    print("| endpoint, backend | p50 ms | p95 ms | requests/s | failures | forward + rollout ms | whole handler ms |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['name']} | {row['p50']:.1f} | {row['p95']:.1f} | {row['throughput']:.1f} | "
              f"{row['failures']} | {row['model']} | {row['handler']} |")
        if row["first_error"]:
            print(f"  first failure: {row['first_error']}")
    print(f"\nload average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after "
          f"({os.cpu_count()} cores); {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"command: python {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
