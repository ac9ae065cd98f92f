"""The HTTP endpoints of ``torch-handle serve``: litserve APIs that batch concurrent requests into one decoding call.

litserve runs each API's model in a worker process and hands it the requests that arrived within ``batch_timeout``
(up to ``max_batch_size``); a batch shares one ``Model.translate``/``summarize`` call per set of decoding options.
A batch fails or succeeds as a whole, so everything a request can get wrong is checked before it is queued, in the
HTTP process, by the pydantic model :class:`TextsRequest`: a bad request gets its own 4xx and never reaches a batch.
No ``from __future__ import annotations`` here: litserve and FastAPI read the request and response types from the
annotations at run time.
"""

from dataclasses import dataclass
from typing import Any

import litserve as ls
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, model_validator
from typing_extensions import Self


@dataclass
class Limits:
    """What one request may ask, set by ``torch-handle serve`` before the HTTP processes start (they are forked,
    so they inherit it): pydantic validators cannot be handed per-server values otherwise."""

    max_texts: int = 64
    max_chars: int = 20_000
    max_new_tokens: int = 256  # the model's own default or --max-new-tokens, within its context less <bos>
    lowered_default: int | None = None  # --max-new-tokens, where it is below the model's own default
    max_body_bytes: int = 64 * 20_000 * 6 + 65_536  # every text at its longest, each character \u-escaped


LIMITS = Limits()


class TextsRequest(BaseModel):
    """``{"texts": [...]}`` and optional decoding options; those left out take the model file's defaults."""

    texts: list[str] = Field(description="the sentences or documents, outputs come back in the same order")
    num_beams: int | None = Field(None, ge=1, le=64, description="beam width (1: greedy)")
    max_new_tokens: int | None = Field(None, ge=1, description="longest output, in tokens")
    length_penalty: float | None = Field(None, ge=0, le=10, description="beam-search length normalisation exponent")

    @model_validator(mode="after")
    def _within_limits(self) -> Self:
        if len(self.texts) > LIMITS.max_texts:
            raise ValueError(f"{len(self.texts)} texts, more than the {LIMITS.max_texts} one request may send")
        for i, text in enumerate(self.texts):
            if len(text) > LIMITS.max_chars:
                raise ValueError(f"texts[{i}] has {len(text)} characters, more than the limit of {LIMITS.max_chars}")
        limit = LIMITS.max_new_tokens
        if self.max_new_tokens is not None and self.max_new_tokens > limit:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} is over this server's limit: pass at most {limit}")
        return self

    def options(self) -> tuple[int | None, int | None, float | None]:
        """The decoding options; ``max_new_tokens`` left out is the model's default, or the server's lower cap."""
        max_new_tokens = LIMITS.lowered_default if self.max_new_tokens is None else self.max_new_tokens
        return self.num_beams, max_new_tokens, self.length_penalty


class Translations(BaseModel):
    translations: list[str]


class Summaries(BaseModel):
    summaries: list[str]


class _TextsAPI(ls.LitAPI):
    """One endpoint of a model that ``torch_handle.load`` takes; requests with the same options decode together."""

    method = "translate"

    def __init__(self, model_path: str, quantize: str | None = None, **kwargs: Any) -> None:
        super().__init__(api_path=f"/{self.method}", **kwargs)
        self.model_path, self.quantize = model_path, quantize

    def setup(self, device: str) -> None:
        from torch_handle.api import load

        self.model = load(self.model_path, device=device, quantize=self.quantize)

    def decode_request(self, request: TextsRequest) -> TextsRequest:
        return request

    def batch(self, inputs: list[TextsRequest]) -> list[TextsRequest]:
        return inputs

    def predict(self, requests: TextsRequest | list[TextsRequest]) -> list[str] | list[list[str]]:
        """The outputs of one request, or (batched) of each request."""
        if isinstance(requests, TextsRequest):  # max_batch_size 1: litserve hands requests one by one
            return self._decode([requests])[0]
        return self._decode(requests)

    def _decode(self, requests: list[TextsRequest]) -> list[list[str]]:
        groups: dict[tuple[int | None, int | None, float | None], list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(request.options(), []).append(i)
        outputs: list[list[str]] = [[] for _ in requests]
        decode = getattr(self.model, self.method)
        for (num_beams, max_new_tokens, length_penalty), members in groups.items():
            texts = [text for i in members for text in requests[i].texts]
            if not texts:
                continue
            out = iter(decode(texts, num_beams=num_beams, max_new_tokens=max_new_tokens, length_penalty=length_penalty))
            for i in members:
                outputs[i] = [next(out) for _ in requests[i].texts]
        return outputs

    def unbatch(self, outputs: list[list[str]]) -> list[list[str]]:
        return outputs


class TranslateAPI(_TextsAPI):
    method = "translate"

    def encode_response(self, output: list[str]) -> Translations:
        return Translations(translations=output)


class SummarizeAPI(_TextsAPI):
    method = "summarize"

    def encode_response(self, output: list[str]) -> Summaries:
        return Summaries(summaries=output)


async def one_line_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's list of validation errors as one message: 400 for a body that is not a JSON object, else 422."""
    first = error.errors()[0]
    if first.get("type") == "json_invalid":
        return JSONResponse({"detail": 'the body is not JSON: send {"texts": ["..."]}'}, status_code=400)
    if first.get("type") in ("model_attributes_type", "dict_type") and tuple(first.get("loc", ())) == ("body",):
        message = 'the body must be a JSON object: send {"texts": ["..."]} with Content-Type: application/json'
        return JSONResponse({"detail": message}, status_code=400)
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = 'a required field is missing: send {"texts": ["..."]}'
    return JSONResponse({"detail": f"{where}: {message}" if where else message}, status_code=422)


class BodyLimit:
    """ASGI middleware: a 413 line for a body over ``LIMITS.max_body_bytes``, read no further than the limit, so a
    large body is never held whole; a body within it is replayed to the endpoint."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = LIMITS.max_body_bytes
        detail = f"the body is over {limit} bytes: send fewer or shorter texts"
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > limit:
                return await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        pending = iter(messages)

        async def replay() -> dict:
            return next(pending, None) or await receive()

        return await self.app(scope, replay, send)


def build_server(
    model_path: str, max_batch_size: int, batch_timeout: float, accelerator: str = "auto", quantize: str | None = None
) -> ls.LitServer:
    """A LitServer with ``/translate`` and ``/summarize`` (one worker each), ``/health`` and OpenAPI docs; the model
    loaded with ``quantize`` (see :func:`torch_handle.load`)."""
    apis = [
        api(model_path, quantize, max_batch_size=max_batch_size, batch_timeout=batch_timeout)
        for api in (TranslateAPI, SummarizeAPI)
    ]
    server = ls.LitServer(apis, accelerator=accelerator, devices=1, workers_per_device=1, timeout=600)
    server.app.add_exception_handler(RequestValidationError, one_line_error)
    server.app.add_middleware(BodyLimit)
    return server
