"""examples/gpu_server.py under load, as a client meets it: bursts of concurrent requests, and
its memory through a burst of large uploads.

Starts `python examples/gpu_server.py` on 127.0.0.1 in its own process (OMP_NUM_THREADS=1) and
reads its resident memory from /proc (VmRSS now; VmHWM the peak, reset through
/proc/PID/clear_refs before each burst):

  1. bursts: --rounds times, 4 x --batch clients at once (each its own connection, released
     together), each posting a bundled digit: how many were answered (200), refused with 503
     (the queue, --queue: 2 x --batch by default), anything else, or got no answer within
     --client-timeout s;
  2. large uploads: --large clients at once, each posting a PNG of a few kilobytes that decodes
     to 16 megapixels (a blank 15.9 MP 16-bit RGBA PNG: decoded, then refused for no ink; and
     a 15.9 MP RGBA PNG of a dark bar on white, answered), --large-rounds times: the peak over
     the idle server, and what it holds 2 s after each burst.

    python bench/gpu_server_load.py [--model models/vit-mnist] [--batch 64] [--rounds 3] [--large 20]

Prints one JSON object. Needs a checkout's venv; on a GPU machine the network runs on CUDA.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.app_limits import SIDE, blank_png, digit_rgba  # noqa: E402

DIGIT = ROOT / "vit_hub" / "bundled" / "samples" / "mnist_test_0000_label_7.png"


class ServerProcess:
    """`python examples/gpu_server.py` in its own process, and its memory."""

    def __init__(self, model: str, batch: int, queue: int | None):
        command = [sys.executable, "examples/gpu_server.py", "--model", model, "--port", "0", "--batch", str(batch)]
        command += ["--queue", str(queue)] if queue else []
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        self.banner = self.process.stdout.readline().strip()  # "serving ... on http://127.0.0.1:PORT/classify ..."
        found = re.search(r":(\d+)/classify", self.banner)
        if not found:
            self.process.kill()
            raise SystemExit(f"the server did not start: {self.banner} {self.process.stderr.read()}")
        self.port = int(found[1])

    def memory_mb(self) -> tuple[float, float]:
        """(VmRSS, VmHWM) in MB."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return tuple(int(re.search(rf"{key}:\s+(\d+) kB", status)[1]) / 1024 for key in ("VmRSS", "VmHWM"))

    def reset_peak(self) -> None:
        Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")

    def stop(self) -> str:
        """Stops it; its stderr."""
        self.process.terminate()
        _, stderr = self.process.communicate(timeout=60)
        return stderr


def post(port: int, body: bytes, timeout: float, start: threading.Barrier | None = None) -> str:
    """One request on its own connection: its status as text, or how it failed."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.connect()
        if start is not None:
            start.wait()
        connection.request("POST", "/classify", body, {"Content-Type": "application/octet-stream"})
        reply = connection.getresponse()
        reply.read()
        return str(reply.status)
    except TimeoutError:
        return "no answer"
    except OSError as error:
        return type(error).__name__
    finally:
        connection.close()


def burst(port: int, bodies: list[bytes], timeout: float) -> Counter:
    """Every body posted at once, each by its own client: the count of each outcome."""
    start = threading.Barrier(len(bodies))
    with ThreadPoolExecutor(len(bodies)) as pool:
        return Counter(pool.map(lambda body: post(port, body, timeout, start), bodies))


def settle(server: ServerProcess, seconds: float = 2.0) -> float:
    time.sleep(seconds)
    return round(server.memory_mb()[0], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/vit-mnist")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--queue", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--large", type=int, default=20)
    parser.add_argument("--large-rounds", type=int, default=3)
    parser.add_argument("--client-timeout", type=float, default=300.0)
    args = parser.parse_args()

    server = ServerProcess(args.model, args.batch, args.queue)
    digit = DIGIT.read_bytes()
    with tempfile.TemporaryDirectory() as folder:
        blank = blank_png(Path(folder) / "blank.png", SIDE, SIDE, "16-bit RGBA").read_bytes()
        bar = digit_rgba(Path(folder) / "bar.png", SIDE).read_bytes()
    result = {"server": server.banner, "digit_bytes": len(digit), "blank_bytes": len(blank), "bar_bytes": len(bar)}
    try:
        post(server.port, digit, args.client_timeout)  # warm: the sessions' first runs
        post(server.port, bar, args.client_timeout)
        result["idle_mb"] = settle(server)
        rounds = []
        for _ in range(args.rounds):
            started = time.perf_counter()
            outcomes = burst(server.port, [digit] * (4 * args.batch), args.client_timeout)
            rounds.append({"clients": 4 * args.batch, **dict(outcomes), "seconds": round(time.perf_counter() - started, 2)})
        result["bursts"] = rounds
        result["idle_after_bursts_mb"] = settle(server)
        large = []
        for _ in range(args.large_rounds):
            server.reset_peak()
            bodies = [blank if index % 2 else bar for index in range(args.large)]
            outcomes = burst(server.port, bodies, args.client_timeout)
            peak = server.memory_mb()[1]
            large.append({"clients": args.large, **dict(outcomes), "peak_mb": round(peak, 1),
                          "held_after_2s_mb": settle(server)})
        result["large"] = large
        result["held_over_idle_mb"] = round(large[-1]["held_after_2s_mb"] - result["idle_mb"], 1)
    finally:
        stderr = server.stop()
    result["server_stderr_lines"] = len(stderr.splitlines())
    result["server_stderr_tracebacks"] = stderr.count("Traceback")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
