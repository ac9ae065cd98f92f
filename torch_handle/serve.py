"""``torch-handle serve MODEL``: a model that ``torch_handle.load`` takes, behind HTTP with dynamic batching.

``POST /translate`` and ``POST /summarize`` take ``{"texts": [...], "num_beams": ..., ...}`` and answer
``{"translations": [...]}`` or ``{"summaries": [...]}``; ``GET /health`` says ``ok`` once the model is loaded, and
``/docs`` holds the OpenAPI page. Concurrent requests are decoded together (:mod:`torch_handle.server`, on
``litserve``, an optional extra: ``pip install "torch-handle[serve]"``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time

from lightning_utilities.core.imports import RequirementCache

from torch_handle.checkpoints import CheckpointError
from torch_handle.commands import typed_command
from torch_handle.errors import SetupError

LITSERVE_AVAILABLE = RequirementCache("litserve")
log = logging.getLogger(__name__)


def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch_size: int = 32,
    batch_timeout: float = 0.01,
    max_texts: int = 64,
    max_chars: int = 20_000,
    accelerator: str = "auto",
    max_new_tokens: int | None = None,
    quantize: str | None = None,
) -> None:
    """Serves ``model`` until interrupted; the model is loaded once here first, so a bad path is one error line.

    A request may ask for at most ``max_new_tokens`` (default: the model's own decoding default), within its context.
    ``quantize="int8"`` serves the model with int8 linears (:func:`torch_handle.load`'s), on the CPU.
    """
    if not LITSERVE_AVAILABLE:
        raise SetupError('torch-handle serve needs litserve: pip install "torch-handle[serve]"')
    if max_batch_size < 1 or batch_timeout < 0 or max_texts < 1 or max_chars < 1:
        raise SetupError("--max-batch-size, --max-texts and --max-chars must be >= 1, --batch-timeout >= 0")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise SetupError(f"--max-new-tokens {max_new_tokens}: pass a number >= 1")
    if quantize is not None and accelerator == "cuda":
        raise SetupError(f"--quantize {quantize} decodes on the CPU: pass --accelerator cpu, or leave --quantize out")
    from torch_handle.api import load
    from torch_handle.server import LIMITS, build_server

    loaded = load(model, quantize=quantize)
    context = loaded.model.config.target_length  # the decoder's positions
    fits = None if context is None else context - 1  # <bos> takes a position
    if max_new_tokens is not None and fits is not None and max_new_tokens > fits:
        raise SetupError(
            f"--max-new-tokens {max_new_tokens} does not fit the model's max_len={context}: pass <= {fits}"
        )
    default = loaded.decoding.max_new_tokens
    cap = default if max_new_tokens is None else max_new_tokens
    cap = cap if fits is None else min(cap, fits)
    LIMITS.max_texts, LIMITS.max_chars, LIMITS.max_new_tokens = max_texts, max_chars, cap
    LIMITS.lowered_default = cap if cap < default else None
    LIMITS.max_body_bytes = 6 * max_texts * max_chars + 65_536
    where = "cpu" if quantize is not None else accelerator
    server = build_server(model, max_batch_size, batch_timeout, where, quantize)
    log.info("serving %s on http://%s:%d (POST /translate, /summarize; GET /health, /docs)", model, host, port)
    stopping = _SigtermStops(server) if threading.current_thread() is threading.main_thread() else None
    try:
        server.run(host=host, port=port, generate_client_file=False, log_level="info")
    except KeyboardInterrupt:  # litserve shuts down what it started only once its HTTP servers run
        for child in multiprocessing.active_children():  # the model workers still loading
            child.terminate()
            child.join(timeout=10)
    finally:
        if stopping is not None:
            stopping.restore()


class _SigtermStops:
    """SIGTERM to the server's process (``kill PID``, ``docker stop``) shuts it down as Ctrl-C does, where the default
    action would end this process alone and leave its workers serving.

    The handler raises ``KeyboardInterrupt``, which stops the workers still loading at once; but Python drops an
    exception raised inside a fork's callbacks, so a thread also sets litserve's shutdown event, which ends the run
    as soon as it serves.
    """

    def __init__(self, server: object) -> None:
        self.server, self.server_pid = server, os.getpid()
        self.requested, self.done = threading.Event(), threading.Event()
        self.previous = signal.signal(signal.SIGTERM, self._stop)
        threading.Thread(target=self._set_shutdown_event, name="sigterm-shutdown", daemon=True).start()

    def _stop(self, signum: int, frame: object) -> None:
        if os.getpid() != self.server_pid:  # a worker forked from here ends as it would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.requested.is_set():  # a second one does not cut the shutdown short
            return
        log.info("SIGTERM: stopping the server and its workers")
        self.requested.set()
        raise KeyboardInterrupt

    def _set_shutdown_event(self) -> None:
        self.requested.wait()
        while not self.done.is_set():
            event = getattr(self.server, "_shutdown_event", None)  # litserve's, once its manager runs
            if event is not None:
                with contextlib.suppress(Exception):  # the manager may already be shut down
                    event.set()
                return
            time.sleep(0.1)

    def restore(self) -> None:
        self.done.set()
        signal.signal(signal.SIGTERM, self.previous)


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=typed_command("serve"), description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .safetensors export, a .ckpt file, a checkpoint folder or a run folder")
    parser.add_argument("--host", default="127.0.0.1", help="the interface to listen on (0.0.0.0: every one)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch-size", type=int, default=32, help="requests decoded together at most")
    parser.add_argument(
        "--batch-timeout", type=float, default=0.01, help="seconds a request waits for others to batch with"
    )
    parser.add_argument("--max-texts", type=int, default=64, help="texts one request may send at most")
    parser.add_argument("--max-chars", type=int, default=20_000, help="characters one text may have at most")
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="longest output a request may ask (default: the model's own)"
    )
    parser.add_argument("--accelerator", default="auto", choices=("auto", "cpu", "cuda"), help="where to decode")
    parser.add_argument(
        "--quantize", choices=("int8",), default=None, help="int8: the model's linears in int8, decoding on the CPU"
    )
    options = parser.parse_args(args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        serve(
            options.model,
            options.host,
            options.port,
            options.max_batch_size,
            options.batch_timeout,
            options.max_texts,
            options.max_chars,
            options.accelerator,
            options.max_new_tokens,
            options.quantize,
        )
    except (CheckpointError, SetupError) as err:
        raise SystemExit(f"error: {err}") from err


if __name__ == "__main__":
    main()
