"""The HTTP application (``create_app``): OpenAI-compatible completions and chat completions over the engine,
health, model list and metrics; every refusal is OpenAI's error shape with a one-line message (docs/serving.md)."""

import asyncio
import functools
import gc
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..data.tokenizers import resolve_tokenizer
from ..models.model_dir import export_tier_aliases
from . import schema
from .engine import COUNTERS, PREFILL_TOKENS, PREFILL_WAIT_MS, Busy, Engine, Request
from .guard import Guard, parse_json, read_body, watch_disconnect
from .remote import RemoteEngine
from .schema import ApiError, error_body, parse_prompt, resolve_model_field, response_body
from .slots import GRAPH_TOKENS
from .tokens import ChatTemplate

__all__ = ["ServerSettings", "create_app", "Metrics"]

log = logging.getLogger("elastic_ssm.serve")
#: the refusals a route documents in /openapi.json, all in OpenAI's error shape (never FastAPI's 422)
_ERRORS = {"4XX": {"model": schema.ErrorResponse, "description": "refused: 400 a bad field, 401 no key, 404 another "
                   "model, 408 too slow, 413 too large, 415 not JSON, 421 another host, 429 too many "
                   "requests from one client"},
           "5XX": {"model": schema.ErrorResponse, "description": "500 a failure in the server, 503 busy (Retry-After)"}}
#: the text exposition format ``generate_latest`` writes
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_POOL = {"slots": "Slots of the one pool every tier shares (its decode batch bucket)",
         "busy": "Slots holding a running request at the tier",
         "waiting": "Requests of the tier queued for a free slot"}


class Metrics:
    """The ``prometheus_client`` counters of one server process, in a registry of their own; when scraped it reads the
    slots, tokens generated per tier and the loop's counters of ``engine()`` (None: not started)."""

    def __init__(self, engine) -> None:
        self.registry, self.engine, self.started = CollectorRegistry(), engine, time.time()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"elastic_ssm_{name}", doc, labels, registry=self.registry)

        self.requests = counter("requests", "Completion requests by tier and HTTP status.", ("tier", "status"))
        self.rejected = counter("rejected", "Requests refused before reaching a tier, by reason.", ("reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled, by tier.", ("tier",))
        self.server_errors = counter("server_errors", "Requests ended by an unexpected exception (HTTP 500).")
        self.registry.register(self)

    def request(self, tier: str, status: int, prompt_tokens: int = 0) -> None:
        self.requests.labels(tier, str(status)).inc()
        self.prompt_tokens.labels(tier).inc(prompt_tokens)

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def collect(self):
        """The engine's gauges and counters at scrape time (``Metrics`` is a registry collector)."""
        engine = self.engine()
        if engine is not None:
            snap, counters = engine.snapshot(), engine.counters()
            family = CounterMetricFamily("elastic_ssm_generated_tokens", "Tokens generated, by tier.", labels=["tier"])
            for tier, n in dict(engine.generated).items():       # a copy: the engine thread may add a tier
                family.add_metric([tier], n, created=self.started)
            yield family
            for key, doc in _POOL.items():
                family = GaugeMetricFamily(f"elastic_ssm_{key}", f"{doc}.", labels=["tier"])
                for tier, v in snap.items():
                    family.add_metric([tier], v[key])
                yield family
            for key, doc in COUNTERS.items():
                yield CounterMetricFamily(f"elastic_ssm_{key}", f"{doc}.", value=counters[key])
        yield GaugeMetricFamily("elastic_ssm_uptime_seconds", "Seconds since the server started.",
                                value=time.time() - self.started)


@dataclass
class ServerSettings:
    """What ``elastic-ssm serve`` configures (its flags; see ``serve/cli.py``)."""

    name: str
    tiers: list[str]
    default_tier: str
    slots: int = 8
    max_prefill: int = 16
    max_prefill_tokens: int = PREFILL_TOKENS
    prefill_wait_ms: float = PREFILL_WAIT_MS
    prefill_graphs: bool = True          # graphed prefill on CUDA; False: eager everywhere
    prefill_graph_tokens: int = GRAPH_TOKENS   # the largest graphed prefill, padded prompt tokens
    attended_spans: bool = True          # decode steps read the window rings' filled prefix only
    api_key: str | None = None
    max_queue: int = 64
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 8192
    max_tokens_limit: int = 4096
    max_connections_per_client: int = 32
    max_requests: int | None = None          # in flight from all clients (``--max-connections``); None: no cap
    timeout_s: float = 30.0                  # --timeout: for a body to arrive, for a client to take its output
    chat_template: str | None = None         # Jinja source from --chat_template; None: the directory's own
    #: ``Host`` names admitted beyond the loopback ones without an API key (``guard.Guard``); None: no check
    allowed_hosts: tuple[str, ...] | None = ()

    def engine_options(self) -> dict:
        """The ``Engine`` keyword arguments among these settings (admission, prefill and decode choices)."""
        return {k: getattr(self, k) for k in ("max_prefill", "max_prefill_tokens", "prefill_wait_ms", "prefill_graphs",
                                               "prefill_graph_tokens", "attended_spans")}


_MARK = "\x00text\x00"


def _text_event(render_chunk):
    """``text -> "data: <chunk JSON>\\n\\n"`` for a request's text chunks after its first (``render_chunk(text,
    finish_reason)``), rendered once around a marker (the bytes of ``json.dumps`` of the whole chunk)."""
    head, _, tail = json.dumps(render_chunk(_MARK, None)).partition(json.dumps(_MARK))
    return lambda text: f"data: {head}{json.dumps(text)}{tail}\n\n"


def create_app(model, settings: ServerSettings, pool_factory=None, load=None):
    """The FastAPI app serving ``model``; its lifespan starts and stops the engine. With ``load`` (a picklable model
    builder) the engine runs in its own process (``app.state.engine``, a ``RemoteEngine`` whose ``start`` may be
    called early; ``model`` may be ``remote.model_view``), else in a thread. ``pool_factory``: ``Engine``'s."""
    metrics = Metrics(lambda: app.state.engine)     # read at scrape time (app: below)
    tok = resolve_tokenizer(model)                   # the saved one; bytes for a model saved without one
    aliases = export_tier_aliases(model)             # an older export answers to its source tier's name too
    eos = model.config.eos_token_id if model.config.eos_token_id >= 0 else None
    chat = ChatTemplate.from_model(model, tok, settings.chat_template)
    vocab = model.config.vocab_size
    Completion, Chat = schema.request_models(settings.max_tokens_limit, vocab)
    bodies = {"/v1/completions": Completion, "/v1/chat/completions": Chat}

    sizes = (settings.tiers, settings.slots, settings.max_queue, settings.timeout_s)
    options = {"eos": eos, "tokenizer": tok, **settings.engine_options(),
               **({} if pool_factory is None else {"pool_factory": pool_factory})}
    remote = None if load is None else RemoteEngine(load, model, *sizes, **options)

    @asynccontextmanager
    async def lifespan(app):
        if remote is not None:
            eng = remote.start()
            eng.attach(asyncio.get_running_loop())
        else:
            eng = Engine(model, *sizes, **options).start()
        app.state.engine = eng
        gc.freeze()          # start-up's objects out of the collector's sight (a full collection paused arrivals)
        try:
            yield
        finally:
            gc.unfreeze()
            eng.shutdown()

    class BoundedRoute(APIRoute):
        """A route whose body ``guard`` reads and parses first, into Starlette's caches where FastAPI reads it."""

        def get_route_handler(self):
            handler = super().get_route_handler()

            async def read_first(request):
                kind = request.headers.get("content-type")      # application/json or .../...+json, no web form
                media = "application/json" if kind is None else kind.split(";", 1)[0].strip().lower()
                if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
                    raise ApiError(415, f"the request body must be JSON (Content-Type: application/json), not "
                                        f"{kind[:60]!r}; a body without a Content-Type is read as JSON")
                coding = request.headers.get("content-encoding", "identity").strip().lower()
                if coding != "identity":            # compressed bodies are not read (gzip's was "not UTF-8 JSON")
                    raise ApiError(415, f"Content-Encoding {coding[:40]!r} is not supported; send the body "
                                        "uncompressed")
                raw = await read_body(request, settings.max_body_bytes, settings.timeout_s)
                request._body, request._json = raw, parse_json(raw)
                return await handler(request)
            return handler if self.body_field is None else read_first

    app = FastAPI(title="elastic-ssm", summary="OpenAI-compatible completions at every tier of one elastic model",
                  lifespan=lifespan, docs_url=None, redoc_url=None, strict_content_type=False)
    app.router.route_class = BoundedRoute
    app.state.engine, app.state.metrics = remote, metrics
    app.add_middleware(Guard, api_key=settings.api_key, max_connections=settings.max_connections_per_client,
                       max_body=settings.max_body_bytes, metrics=metrics, max_requests=settings.max_requests,
                       allowed_hosts=settings.allowed_hosts)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        metrics.reject(f"http_{exc.status}")
        return JSONResponse(error_body(exc.status, exc.message, exc.param), exc.status, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        """Every field's refusal: a 400 in OpenAI's shape naming the field (``schema.error_message``)."""
        errors = exc.errors()       # a form of a union refusing unpaired surrogates says more than the others
        error = next((e for e in errors if e["type"] == "string_unicode"), errors[0])
        message, param = schema.error_message(error, bodies[request.scope["route"].path])
        return await _api_error(request, ApiError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        """Starlette's own refusals (an unknown path, a method the path does not take) in OpenAI's error shape."""
        if exc.status_code == 404:
            message = f"no such endpoint: {request.url.path[:80]}; see GET /v1/models, POST /v1/completions, " \
                      "POST /v1/chat/completions, GET /health, GET /metrics, GET /openapi.json"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow")
            message = f"{request.method} is not allowed on {request.url.path}" + (f"; use {allowed}" if allowed else "")
        else:
            message = str(exc.detail)
        return JSONResponse(error_body(exc.status_code, message), exc.status_code, exc.headers)

    @app.head("/health")        # load balancers' and `curl -I`'s probe; a route of its own, so its operationId too
    @app.get("/health")
    async def health():
        eng = app.state.engine
        if not eng.alive():
            return JSONResponse({"status": "engine stopped", "model": settings.name}, 503)
        return {"status": "ok", "model": settings.name, "tiers": eng.snapshot()}

    started = int(time.time())                   # the cards' `created`: when this server loaded the model
    cards = [schema.ModelCard(id=i, created=started, tier=i.partition("@")[2] or settings.default_tier)
             for i in [settings.name] + [f"{settings.name}@{t}" for t in settings.tiers]]

    @app.get("/v1/models", response_model=schema.ModelList, responses=_ERRORS)
    async def models():
        return schema.ModelList(data=cards)

    @app.get("/v1/models/{model_id:path}", response_model=schema.ModelCard, responses=_ERRORS)
    async def model_card(model_id: str):        # the openai client's models.retrieve
        card = next((c for c in cards if c.id == model_id), None)
        if card is None:
            raise ApiError(404, f"unknown model {schema.shown(model_id)}; GET /v1/models lists this server's", "model")
        return card

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE)

    def tier_of(body) -> str:
        return resolve_model_field(body.model, body.tier, settings.name, settings.tiers, settings.default_tier, aliases)

    async def run_completion(http: HttpRequest, body, prompt: list[int], tier: str, is_chat: bool):
        eng = app.state.engine
        req = Request(tier=tier, prompt=prompt, **body.engine_fields(), loop=asyncio.get_running_loop(),
                      queue=asyncio.Queue())
        try:
            eng.submit(req)
        except Busy as e:
            metrics.request(tier, 503)
            raise ApiError(503, str(e), headers={"Retry-After": "1"}) from None
        model_id = f"{settings.name}@{tier}"
        render_chunk = functools.partial(response_body, req, model_id, is_chat, stream=True)
        client = http.client.host if http.client else "?"
        watcher = asyncio.create_task(watch_disconnect(http.receive, req))
        started = time.monotonic()

        def finish(status: int) -> None:
            """Count and log the request (one that did not run to its end is cancelled: 499)."""
            watcher.cancel()
            if req.finish_reason is None:
                req.cancel()
            reason = req.finish_reason or "cancelled"
            if reason == "cancelled":
                status = 499
            metrics.request(tier, status, len(req.prompt))
            ttft = (req.first_token_at - started) * 1e3 if req.first_token_at else float("nan")
            log.info("%s %s %s prompt=%d completion=%d finish=%s ttft_ms=%.1f total_ms=%.1f status=%d stream=%s",
                     client, req.id, model_id, len(req.prompt), req.completion_tokens, reason,
                     ttft, (time.monotonic() - started) * 1e3, status, body.stream)

        async def events():
            """The request's events, text already waiting joined into one chunk."""
            held = None
            while True:
                ev, held = held or await req.queue.get(), None
                req.took()
                if ev[0] == "text":
                    parts = [ev[1]]
                    while not req.queue.empty():
                        nxt = req.queue.get_nowait()
                        if nxt[0] != "text":
                            held = nxt
                            break
                        req.took()
                        parts.append(nxt[1])
                    ev = ("text", "".join(parts))
                yield ev
                if ev[0] in ("done", "error", "unavailable"):
                    return

        if body.stream:
            async def sse():
                status = 200
                text_event = None
                try:
                    async for kind, value in events():
                        if kind == "text" and text_event is not None:
                            yield text_event(value)
                            continue
                        if kind == "text":         # the first text chunk as rendered (chat names the role in it)
                            chunk, text_event = render_chunk(value, None), _text_event(render_chunk)
                        elif kind == "done":
                            chunk = render_chunk("", value)
                        else:                      # an error, or the engine gone ("unavailable": retry)
                            status = 503 if kind == "unavailable" else 500
                            chunk = error_body(status, value)
                        yield f"data: {json.dumps(chunk)}\n\n"
                    if body.stream_options and body.stream_options.include_usage and status == 200:
                        yield f"data: {json.dumps(render_chunk(usage=True))}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    finish(status)

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        parts, status = [], 200
        try:
            async for kind, value in events():
                if kind == "text":
                    parts.append(value)
                elif kind in ("error", "unavailable"):       # "unavailable": the engine is gone, retry
                    status = 503 if kind == "unavailable" else 500
                    return JSONResponse(error_body(status, value), status,
                                        {"Retry-After": "1"} if status == 503 else None)
        finally:
            finish(status)
        return response_body(req, model_id, is_chat, "".join(parts), req.finish_reason)

    sse = {"description": "the completion; with stream: true, server-sent events of its chunks, then data: [DONE]",
           "content": {"text/event-stream": {}}}

    @app.post("/v1/completions", response_model=schema.CompletionResponse, responses={**_ERRORS, 200: sse})
    async def completions(body: Completion, http: HttpRequest):
        prompt = parse_prompt(body.prompt, tok, vocab, settings.max_prompt_tokens)
        return await run_completion(http, body, prompt, tier_of(body), False)

    @app.post("/v1/chat/completions", response_model=schema.ChatCompletionResponse, responses={**_ERRORS, 200: sse})
    async def chat_completions(body: Chat, http: HttpRequest):
        if chat is None:
            raise ApiError(400, "this model has no chat template: start the server with --chat_template chatml (or "
                                "plain, or a Jinja file), or send a prompt to /v1/completions")
        tier = tier_of(body)
        try:
            prompt = parse_prompt(chat.prompt(body.messages), tok, vocab, settings.max_prompt_tokens)
        except ApiError as e:      # the prompt is the template's rendering of the client's messages: name those
            raise ApiError(e.status, f"messages, as the chat template renders them: {e.message}", "messages") \
                if e.param == "prompt" else e from None
        return await run_completion(http, body, prompt, tier, True)

    return app
