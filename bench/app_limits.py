"""The app's limits as a client meets them: memory per request, memory after bursts, and
what the queue answers when more requests come at once than it holds.

Starts `python app.py` on 127.0.0.1 in its own process and reads its resident memory from
/proc (VmRSS now, VmHWM the peak, reset through /proc/PID/clear_refs before each step):

  1. one request alone of the largest image the app accepts (a 16 MP RGBA PNG with a digit
     in it, answered) and of a blank 16 MP 16-bit RGBA PNG (decoded, then refused: no ink):
     the peak over the idle server;
  2. bursts of refused blank images and answered digits, `--burst` requests `--burst-concurrency`
     at a time, three times: the peak, and what is still held 3 s after each;
  3. `--steady` requests of /predict of a small digit, `--steady-concurrency` at a time, in
     four rounds: resident memory after each (does it plateau?);
  4. `--flood` requests of /predict_labels at once (`--flood-concurrency` client threads):
     how many the queue refuses with HTTP 503 "Queue is full" (Gradio refuses a request when
     the queue holds page.QUEUE_SIZE).

    python bench/app_limits.py [--model models/vit-mnist] [--burst 100] [--burst-concurrency 50]
                               [--steady 1000] [--steady-concurrency 20] [--flood 200] [--flood-concurrency 100]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import httpx
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
CONTROLS = ("mean", 0.0, 3, "rollout")
SIDE = 3_990  # 15.9 MP: just under the app's 16 MP limit


# A blank PNG's header fields: (bit depth, colour type, bytes a pixel in a row).
PNG_KINDS = {"1-bit gray": (1, 0, 1 / 8), "RGBA": (8, 6, 4), "16-bit RGBA": (16, 6, 8)}


def blank_png(path: Path, width: int, height: int, kind: str = "1-bit gray") -> Path:
    """A genuine blank PNG of any size (one of PNG_KINDS), compressed row by row: kilobytes on
    disk however many megapixels it decodes to."""
    def chunk(name: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + name + data + struct.pack(">I", zlib.crc32(name + data))

    depth, colour, per_pixel = PNG_KINDS[kind]
    row = b"\x00" * (1 + math.ceil(width * per_pixel))  # filter byte + pixels
    compressor = zlib.compressobj(9)
    pixels = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))
    return path


def digit_rgba(path: Path, side: int) -> Path:
    """A large RGBA image the app accepts: a dark square on white, side x side pixels."""
    image = Image.new("RGBA", (side, side), (255, 255, 255, 255))
    image.paste((0, 0, 0, 255), (side // 3, side // 4, side // 2, 3 * side // 4))
    image.save(path)
    return path


class Server:
    """`python app.py` in its own process, and its memory."""

    def __init__(self, model: str, port: int):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
        self.process = subprocess.Popen([sys.executable, "app.py", "--model", model, "--port", str(port)], cwd=ROOT,
                                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}/"
        for _ in range(600):
            try:
                httpx.get(f"{self.url}config", timeout=5).raise_for_status()
                return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError("the app did not start")

    def memory_mb(self) -> tuple[int, int]:
        """(resident now, peak since the last reset), MB."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return tuple(int(re.search(rf"^{key}:\s+(\d+) kB", status, re.MULTILINE).group(1)) // 1024
                     for key in ("VmRSS", "VmHWM"))

    def reset_peak(self) -> None:
        Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")

    def call(self, endpoint: str, path: Path, controls=CONTROLS) -> str:
        """Upload `path`, call the endpoint: the last event's name, or the HTTP status if refused."""
        with open(path, "rb") as handle:
            uploaded = httpx.post(f"{self.url}gradio_api/upload", files={"files": (path.name, handle)}, timeout=120)
        file_data = {"path": uploaded.json()[0], "meta": {"_type": "gradio.FileData"}, "orig_name": path.name}
        response = httpx.post(f"{self.url}gradio_api/call/{endpoint}", json={"data": [file_data, *controls]},
                              timeout=300)
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {response.json().get('detail', '')}"
        stream = httpx.get(f"{self.url}gradio_api/call/{endpoint}/{response.json()['event_id']}", timeout=300).text
        return re.findall(r"^event: (\w+)$", stream, re.MULTILINE)[-1]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def one_request_each(server: Server, accepted: Path, blank: Path) -> dict:
    results = {}
    for name, path in (("16 MP RGBA digit (answered)", accepted), ("15.9 MP 16-bit RGBA blank (refused)", blank)):
        idle, _ = server.memory_mb()
        server.reset_peak()
        event = server.call("predict", path)
        now, peak = server.memory_mb()
        results[name] = {"event": event, "idle_mb": idle, "peak_over_idle_mb": peak - idle, "after_mb": now}
    return results


def bursts(server: Server, digit: Path, blank: Path, requests: int, concurrency: int) -> list[dict]:
    def request(index: int) -> str:
        return server.call("predict", digit if index % 10 == 0 else blank)  # 1 in 10 answered

    idle, _ = server.memory_mb()
    results = []
    for _ in range(3):
        server.reset_peak()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            events = list(pool.map(request, range(requests)))
        _, peak = server.memory_mb()
        time.sleep(3)
        after, _ = server.memory_mb()
        results.append({"idle_mb": idle, "peak_mb": peak, "held_3s_later_mb": after, "held_over_idle_mb": after - idle,
                        "events": {event: events.count(event) for event in sorted(set(events))}})
    return results


def steady(server: Server, digit: Path, requests: int, concurrency: int) -> list[dict]:
    idle, _ = server.memory_mb()
    rounds = []
    for _ in range(4):
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            events = list(pool.map(lambda _: server.call("predict", digit), range(requests // 4)))
        rounds.append({"resident_mb": server.memory_mb()[0], "over_idle_mb": server.memory_mb()[0] - idle,
                       "events": {event: events.count(event) for event in sorted(set(events))}})
    return rounds


def flood(server: Server, digit: Path, requests: int, concurrency: int) -> dict:
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        events = list(pool.map(lambda _: server.call("predict_labels", digit, (3,)), range(requests)))
    return {event: events.count(event) for event in sorted(set(events))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "vit-mnist"))
    parser.add_argument("--port", type=int, default=7871)
    parser.add_argument("--burst", type=int, default=100)
    parser.add_argument("--burst-concurrency", type=int, default=50)
    parser.add_argument("--steady", type=int, default=1000)
    parser.add_argument("--steady-concurrency", type=int, default=20)
    parser.add_argument("--flood", type=int, default=200)
    parser.add_argument("--flood-concurrency", type=int, default=100)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="app-limits-"))
    accepted, blank = digit_rgba(folder / "digit16mp.png", 4_000), blank_png(folder / "blank16mp.png", SIDE, SIDE, "16-bit RGBA")
    small_digit = ROOT / "vit_hub" / "bundled" / "samples" / "mnist_test_0000_label_7.png"
    server = Server(args.model, args.port)
    try:
        server.call("predict", small_digit)  # warm
        server.call("predict", blank)
        report = {"one request": one_request_each(server, accepted, blank),
                  f"bursts of {args.burst} at {args.burst_concurrency}": bursts(
                      server, small_digit, blank, args.burst, args.burst_concurrency),
                  f"{args.steady} at {args.steady_concurrency}, in four rounds": steady(
                      server, small_digit, args.steady, args.steady_concurrency),
                  f"{args.flood} at {args.flood_concurrency}": flood(server, small_digit, args.flood,
                                                                       args.flood_concurrency)}
    finally:
        server.stop()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
