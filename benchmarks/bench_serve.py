"""Sentences per second through ``torch-handle serve`` at 1, 8 and 32 concurrent clients, on the CPU.

Starts ``torch-handle serve MODEL`` on a free local port, twice: with dynamic batching (``--max-batch-size 32``)
and one request at a time (``--max-batch-size 1``). Against each, ``C`` client threads send one sentence per request
(``POST /translate``, greedy unless ``--num-beams``) for ``--seconds`` after a warm-up; the rate is the sentences
answered over the wall time. The table gives each setting's rate and batching's rate over the one-at-a-time server
at the same concurrency and at the fewest clients, in RESULTS.md (section ``bench_serve``; ``--no-write`` prints it
only). ``--quantize int8`` adds a third server, batched, with ``--quantize int8``, and its rate over the fp32 batched
one.

    python benchmarks/bench_serve.py --model runs/demo --clients 1 8 32 --seconds 20
    python benchmarks/bench_serve.py --model runs/demo --source data/multi30k/test_2016_flickr.en --no-write
    python benchmarks/bench_serve.py --model runs/multi30k --quantize int8 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_line, markdown_table, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SENTENCES = [
    "A man in a blue shirt is standing on a ladder cleaning windows.",
    "Two young children are playing in the sand at the beach.",
    "A woman is riding a bicycle down a busy city street.",
    "A group of people are sitting around a table eating dinner.",
    "The dog runs through the tall grass in the park.",
    "An old man is reading a newspaper on a wooden bench.",
    "Three girls in dresses are dancing on a stage.",
    "A boy jumps into the swimming pool from the diving board.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, *options: str, threads: int = 1, timeout: float = 600) -> tuple[subprocess.Popen, str]:
    """``torch-handle serve MODEL OPTIONS`` on a free local port in its own process group (its model workers stop
    with it), once ``/health`` answers ``ok``; its output goes to a file, which a pipe nobody reads would fill."""
    port = _free_port()
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "cli.py"), "serve", model, "--port", str(port), *options],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.read().decode().strip('"') == "ok":
                    return process, url
        except OSError:
            pass
        time.sleep(1)
    stop_server(process)
    log.seek(0)
    raise RuntimeError(f"the server did not answer /health within {timeout} s: {log.read()[-3000:]}")


def stop_server(process: subprocess.Popen) -> None:
    """Stops a server that :func:`start_server` started, and its workers."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def _translate(url: str, text: str, num_beams: int) -> None:
    body = json.dumps({"texts": [text], "num_beams": num_beams}).encode()
    request = urllib.request.Request(
        f"{url}/translate", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        assert len(json.loads(response.read())["translations"]) == 1


def _rate(url: str, clients: int, seconds: float, sentences: list[str], num_beams: int) -> float:
    """Sentences answered per second by ``clients`` threads, each sending one sentence per request until the end."""
    done = [0] * clients
    end = time.monotonic() + seconds

    def client(k: int) -> None:
        i = k
        while time.monotonic() < end:
            _translate(url, sentences[i % len(sentences)], num_beams)
            done[k] += 1
            i += clients

    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done) / (time.monotonic() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="anything torch_handle.load takes")
    parser.add_argument("--source", type=Path, help="sentences to send, one a line (default: eight built in)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=20, help="measured time per client count")
    parser.add_argument("--batch-timeout", type=float, default=0.01)
    parser.add_argument("--num-beams", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of each model worker")
    parser.add_argument("--quantize", choices=("int8",), help="also a batched server with --quantize int8")
    parser.add_argument("--no-write", action="store_true", help="print the table only, not into RESULTS.md")
    args = parser.parse_args()
    sentences = args.source.read_text(encoding="utf-8").splitlines()[:512] if args.source else SENTENCES
    machine = machine_line(args.threads, version("torch"))  # the load average before the servers start
    rates: dict[tuple[int, str | None], dict[int, float]] = {}
    servers = [(1, None), (max(args.clients), None)] + ([(max(args.clients), args.quantize)] if args.quantize else [])
    for max_batch_size, quantize in servers:
        options = ["--accelerator", "cpu", "--max-batch-size", str(max_batch_size)]
        options += ["--quantize", quantize] if quantize else []
        process, url = start_server(
            args.model, *options, "--batch-timeout", str(args.batch_timeout), threads=args.threads
        )
        try:
            _rate(url, max(args.clients), 3, sentences, args.num_beams)  # warm-up
            rate = {c: _rate(url, c, args.seconds, sentences, args.num_beams) for c in args.clients}
            rates[max_batch_size, quantize] = rate
        finally:
            stop_server(process)
        print(f"max_batch_size {max_batch_size}, quantize {quantize}: {rate}", file=sys.stderr)
    one, batched = rates[1, None], rates[max(args.clients), None]
    base = one[min(args.clients)]  # the rate of a server answering its fewest clients one request at a time
    quantized = rates.get((max(args.clients), args.quantize), {})
    rows = [
        (c, f"{one[c]:.1f}", f"{batched[c]:.1f}", f"{batched[c] / one[c]:.2f}x", f"{batched[c] / base:.2f}x")
        + ((f"{quantized[c]:.1f}", f"{quantized[c] / batched[c]:.2f}x") if quantized else ())
        for c in args.clients
    ]
    header = (
        "clients",
        "one at a time (sentences/s)",
        f"batched, up to {max(args.clients)} (sentences/s)",
        "batched / one at a time",
        f"batched / one at a time at {min(args.clients)} client(s)",
    ) + ((f"batched, {args.quantize} (sentences/s)", f"{args.quantize} / fp32, batched") if quantized else ())
    table = markdown_table(header, rows)
    print(table)
    if not args.no_write:
        command = " ".join(["python", "benchmarks/bench_serve.py", *sys.argv[1:]])
        body = (
            "## bench_serve: `torch-handle serve` at 1 to 32 concurrent clients on the CPU\n\n"
            f"Command: `{command}`. {machine} Load average at the end "
            f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}.\n\n"
            f"Model `{args.model}`; one sentence a request, `num_beams` {args.num_beams}, {args.seconds:g} s per "
            f"client count after a warm-up; batch timeout {args.batch_timeout:g} s.\n\n{table}"
        )
        write_section("bench_serve", body)


if __name__ == "__main__":
    main()
