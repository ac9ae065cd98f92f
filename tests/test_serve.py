"""``torch-handle serve``: a real server process on 127.0.0.1 and a real HTTP client (urllib): the outputs of
``load(...).translate``, 64 concurrent requests answered, a slow client blocking nobody, and one 4xx line per bad
request with the server still serving after them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.bench_serve import start_server, stop_server
from tests.helpers import free_port
from tests.test_resume import group_members
from torch_handle import serve
from torch_handle.server import LIMITS, TextsRequest

START_TIMEOUT = 300  # seconds for the server and its two model workers to start on a loaded 2-core machine
SENTENCES = ["the dog sees a cat", "my two old birds helped the king", "a man rides a bike", "two children play"]


def post(url: str, body: bytes | dict, timeout: float = 120) -> tuple[int, dict]:
    """The status and JSON answer of a POST of ``body`` (a dict is sent as JSON)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def server(tiny_demo_run: Path) -> Iterator[str]:
    """``torch-handle serve RUN`` on a free local port, batching up to 16 requests; stopped after the module."""
    options = ["--max-batch-size", "16", "--batch-timeout", "0.05", "--max-texts", "8", "--max-chars", "500"]
    process, url = start_server(str(tiny_demo_run), *options, "--accelerator", "cpu", timeout=START_TIMEOUT)
    try:
        yield url
    finally:
        stop_server(process)


@pytest.fixture(scope="module")
def expected(tiny_demo_run: Path) -> dict[str, str]:
    import torch_handle

    model = torch_handle.load(tiny_demo_run)
    return dict(zip(SENTENCES, model.translate(SENTENCES), strict=True))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_outputs_equal_load_translate(server: str, expected: dict[str, str], tiny_demo_run: Path) -> None:
    import torch_handle

    assert post(f"{server}/translate", {"texts": SENTENCES}) == (200, {"translations": list(expected.values())})
    assert post(f"{server}/translate", {"texts": []}) == (200, {"translations": []})
    model = torch_handle.load(tiny_demo_run)
    want = model.summarize(SENTENCES[:2], num_beams=1, max_new_tokens=5)
    assert post(f"{server}/summarize", {"texts": SENTENCES[:2], "num_beams": 1, "max_new_tokens": 5}) == (
        200,
        {"summaries": want},
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_64_concurrent_requests_are_all_answered(server: str, expected: dict[str, str]) -> None:
    texts = [SENTENCES[i % len(SENTENCES)] for i in range(64)]
    with ThreadPoolExecutor(max_workers=64) as pool:
        answers = list(pool.map(lambda text: post(f"{server}/translate", {"texts": [text]}, timeout=300), texts))
    assert answers == [(200, {"translations": [expected[text]]}) for text in texts]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_slow_client_does_not_block_others(server: str, expected: dict[str, str]) -> None:
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as slow:
        body = json.dumps({"texts": [SENTENCES[0]]}).encode()
        head = f"POST /translate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        slow.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body[:5])  # and then nothing
        assert post(f"{server}/translate", {"texts": [SENTENCES[1]]}, timeout=120) == (
            200,
            {"translations": [expected[SENTENCES[1]]]},
        )


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("body", "status", "detail"),
    [
        (b"not json", 400, 'the body is not JSON: send {"texts": ["..."]}'),
        (b"[1, 2]", 400, 'the body must be a JSON object: send {"texts": ["..."]} with Content-Type: application/json'),
        ({"text": ["a"]}, 422, 'texts: a required field is missing: send {"texts": ["..."]}'),
        ({"texts": "a dog"}, 422, "texts: Input should be a valid list"),
        ({"texts": ["a" * 501]}, 422, "texts[0] has 501 characters, more than the limit of 500"),
        ({"texts": ["a"] * 9}, 422, "9 texts, more than the 8 one request may send"),
        ({"texts": ["a"], "num_beams": 0}, 422, "num_beams: Input should be greater than or equal to 1"),
        ({"texts": ["a"], "max_new_tokens": 10**6}, 422, "max_new_tokens=1000000 is over this server's limit: pass"),
        pytest.param(
            {"texts": ["a"], "max_new_tokens": 9},
            422,
            "max_new_tokens=9 is over this server's limit: pass at most 8",
            id="over-the-model-default",
        ),
        pytest.param(
            {"texts": ["a"], "max_new_tokens": 2 * 10**9},
            422,
            "max_new_tokens=2000000000 is over this server's limit",
            id="huge-max-new-tokens",
        ),
        pytest.param(
            b'{"texts": ["' + b"a" * 100_000 + b'"]}',
            413,
            "the body is over 89536 bytes: send fewer or shorter texts",
            id="huge-body",
        ),
    ],
)
def test_bad_input_gets_one_4xx_line_and_the_server_keeps_serving(
    server: str, expected: dict[str, str], body: bytes | dict, status: int, detail: str
) -> None:
    for path in ("/translate", "/summarize"):
        got_status, answer = post(f"{server}{path}", body)
        assert got_status == status and answer["detail"].startswith(detail), answer
        assert "\n" not in answer["detail"]
    assert post(f"{server}/translate", {"texts": [SENTENCES[0]]}) == (200, {"translations": [expected[SENTENCES[0]]]})


def test_a_missing_extra_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve, "LITSERVE_AVAILABLE", False)
    with pytest.raises(SystemExit) as exited:
        serve.main(["runs/demo"])
    assert exited.value.code == 'error: torch-handle serve needs litserve: pip install "torch-handle[serve]"'


def test_a_missing_model_is_one_line_before_any_server_starts(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        serve.main([str(tmp_path / "nothing")])
    assert str(exited.value.code).startswith(
        f"error: {tmp_path / 'nothing'} does not exist: pass a .safetensors export"
    )


def test_requests_are_checked_against_the_server_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LIMITS, "max_texts", 2)
    monkeypatch.setattr(LIMITS, "max_new_tokens", 10)
    assert TextsRequest(texts=["a", "b"], max_new_tokens=10).options() == (None, 10, None)
    with pytest.raises(ValueError, match="3 texts, more than the 2 one request may send"):
        TextsRequest(texts=["a", "b", "c"])
    with pytest.raises(ValueError, match="max_new_tokens=11 is over this server's limit: pass at most 10"):
        TextsRequest(texts=["a"], max_new_tokens=11)
    monkeypatch.setattr(LIMITS, "lowered_default", 10)  # --max-new-tokens below the model's own default
    assert TextsRequest(texts=["a"]).options() == (None, 10, None)
    assert TextsRequest(texts=["a"], max_new_tokens=4).options() == (None, 4, None)


def test_quantize_is_refused_on_a_gpu_in_one_line_before_the_model_loads(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        serve.main([str(tmp_path / "nothing"), "--quantize", "int8", "--accelerator", "cuda"])
    message = "error: --quantize int8 decodes on the CPU: pass --accelerator cpu, or leave --quantize out"
    assert exited.value.code == message


def test_quantize_reaches_every_worker_on_the_cpu(tiny_demo_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # serve() hands the scheme and the CPU to the server (auto would pick a GPU where there is one); each API's worker
    # then loads the model with int8 linears.
    from torch_handle import server as server_module
    from torch_handle.quantize import Int8Attention

    built: list[server_module.ls.LitServer] = []
    original = server_module.build_server

    def build(*args: object) -> server_module.ls.LitServer:
        assert args[3:] == ("cpu", "int8"), args  # the accelerator, the scheme
        built.append(original(*args))  # type: ignore[arg-type]
        monkeypatch.setattr(built[-1], "run", lambda **kwargs: None)
        return built[-1]

    monkeypatch.setattr(server_module, "build_server", build)
    serve.serve(str(tiny_demo_run), quantize="int8")
    for api in built[0].lit_api:
        api.setup("cpu")
        assert any(isinstance(module, Int8Attention) for module in api.model.model.modules())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_quantized_server_answers_as_load_with_quantize(tiny_demo_run: Path) -> None:
    import torch_handle

    model = torch_handle.load(tiny_demo_run, quantize="int8")
    process, url = start_server(str(tiny_demo_run), "--quantize", "int8", timeout=START_TIMEOUT)
    try:
        assert post(f"{url}/translate", {"texts": SENTENCES}) == (200, {"translations": model.translate(SENTENCES)})
        want = model.summarize(SENTENCES[:2], num_beams=1, max_new_tokens=5)
        body = {"texts": SENTENCES[:2], "num_beams": 1, "max_new_tokens": 5}
        assert post(f"{url}/summarize", body) == (200, {"summaries": want})
    finally:
        stop_server(process)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_to_the_server_alone_stops_its_workers_too(tiny_demo_run: Path) -> None:
    """``kill PID`` (a supervisor, ``docker stop``) reaches the main process only: the server shuts down as Ctrl-C
    does, where the default action left its workers answering on the port."""
    process, url = start_server(str(tiny_demo_run), "--accelerator", "cpu", timeout=START_TIMEOUT)
    try:
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert_all_ended(process.pid)
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{url}/health", timeout=5)
    finally:
        stop_server(process)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_while_the_workers_load_leaves_no_process(tiny_demo_run: Path, tmp_path: Path) -> None:
    """SIGTERM before the server answers (its model workers starting): litserve's own shutdown does not cover that
    stretch; every process still ends."""
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "cli.py", "serve", str(tiny_demo_run), "--port", str(free_port()), "--accelerator", "cpu"],
        cwd=Path(__file__).parents[1], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while "serving " not in (tmp_path / "serve.log").read_text():  # the model loaded, the workers starting
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()
        assert_all_ended(process.pid)
    finally:
        stop_server(process)


def test_a_sigterm_whose_interrupt_python_drops_still_stops_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM handled inside a callback whose exceptions Python drops (a fork's, as CI met while litserve forked)
    loses its ``KeyboardInterrupt``: litserve's shutdown event is then set, and the run still ends."""
    from torch_handle.serve import _SigtermStops

    dropped: list[type[BaseException]] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda raised: dropped.append(raised.exc_type))

    class Server:
        _shutdown_event = threading.Event()

    class StopsInCallback:
        def __del__(self) -> None:
            signal.raise_signal(signal.SIGTERM)

    stopping = _SigtermStops(Server())
    try:
        StopsInCallback()  # freed at once: the handler runs in __del__, whose exceptions Python drops
        assert dropped == [KeyboardInterrupt]
        assert Server._shutdown_event.wait(timeout=10)
        signal.raise_signal(signal.SIGTERM)  # a second one leaves the shutdown alone
    finally:
        stopping.restore()
    assert signal.getsignal(signal.SIGTERM) is stopping.previous


def assert_all_ended(group: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while group_members(group):
        assert time.monotonic() < deadline, f"still running: {group_members(group)}"
        time.sleep(0.5)
