"""The HTTP side: aiohttp routes of the agate jobs API over the store and the runner.

    GET  /healthz                       "ok"
    GET  /v1/env, /v1/env/<gpu>         the node (env.Environment), `force=true` re-probes
    POST /v1/jobs/<kind>                dev always; eval, profile where installed; else 501
    GET  /v1/jobs                       kind, status, user, limit, sort filters
    GET  /v1/jobs/<id>                  wait=true&timeout=S long-polls until a terminal status
                                        (or until the client disconnects)
    POST /v1/jobs/<id>/cancel
    GET  /v1/evals/<id>, POST /v1/evals legacy eval paths

Every error is JSON {error_class, reason, message, details, trace_id}: 400 for a body that is not
JSON (or nests deeper than MAX_DEPTH) and for bad query parameters, 422 for a job request that fails
validation (as the reference gateway answers), 401 without a valid token, 404 for unknown routes
and for jobs that do not exist or are not the caller's, 405 for a wrong method, 413 for a body over
--max-body, 429 (reason too_many_jobs) for an identity over --max-queued-per-identity, 410 (reason
job_removed, naming it) for an idempotency key whose job retention removed, 501 for kinds not
runnable here, 507 (reason insufficient_storage) for new work while the state disk is full (under
--min-free-space, or a write met ENOSPC), 500 (reason internal_error) for a gateway bug.

Every route but /healthz needs a token (auth.py) unless the gateway runs with --no-auth; a caller
sees, waits on and cancels only its own jobs. A job's view is rendered once from the stored JSON
text (views.py) and streamed: concurrent readers of a large result share one encoding.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from krex_async.gateway.auth import Auth, Identity
from krex_async.gateway.conns import ConnectionGuard
from krex_async.gateway.env import Environment
from krex_async.gateway.files import low_space
from krex_async.gateway.jobs import JobRunner
from krex_async.gateway.limits import KINDS, STATUSES, TERMINAL, BadRequest, Limits
from krex_async.gateway.store import KeyRemoved, Store, TooMany, disk_full, error
from krex_async.gateway.views import TRACE, Views, request_key

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
MAX_DEPTH = 128  # JSON nesting a request may use; deeper is malformed (and would recurse anyway)
CLIENT_CHECK = 0.5  # seconds between a long poll's checks that its client is still connected
WHO = request_key("who", Identity)  # the caller, set by the middleware


def client_gone(request: web.Request) -> bool:
    """Whether the request's connection has closed (aiohttp drops the transport when it is lost)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether `value` nests lists/objects deeper than `limit` (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


def full_disk(why: str, trace: str) -> dict[str, Any]:
    """The 507 refusal of new work while the state disk is full; accepted jobs are kept."""
    return error(
        "insufficient_storage",
        f"{why}: no new job is accepted until space is freed (jobs already accepted are kept)",
        trace,
    )


def _json(status: int, body: Any, trace_id: str = "") -> web.Response:
    r = web.json_response(body, status=status, dumps=lambda v: json.dumps(v, ensure_ascii=False))
    if trace_id:
        r.headers["X-Trace-Id"] = trace_id
    return r


class Gateway:
    """The app's state: store, runner, environment, waiters for long polls, who may call."""

    def __init__(
        self,
        store: Store,
        runner: JobRunner,
        env: Environment,
        limits: Limits,
        kinds: dict[str, Any],
        missing: dict[str, str],
        auth: Auth,
    ) -> None:
        self.store, self.runner, self.env, self.limits = store, runner, env, limits
        self.kinds, self.missing, self.auth = kinds, missing, auth
        self.views = Views(store, waiting=runner.why_waiting)
        self.waiters: dict[str, set[asyncio.Future[None]]] = {}
        self.polls_left = 0  # long polls ended early because their client disconnected
        self.min_free = 0  # --min-free-space: below it on the state disk, new jobs are 507
        self.guard: ConnectionGuard | None = None  # connections per address, idle ones without a token
        self.closing = False

    def close(self) -> None:
        """Shutting down: every long poll answers now, with the job as it is."""
        self.closing = True
        for job_id in list(self.waiters):
            self.changed(job_id)

    def changed(self, job_id: str) -> None:
        for f in self.waiters.pop(job_id, ()):
            if not f.done():
                f.set_result(None)

    # ------------------------------------------------------------------------------ middleware

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        got = request.headers.get("X-Trace-Id", "")
        trace = got if got and len(got) <= 128 and got.isprintable() else f"req-{secrets.token_hex(6)}"
        request[TRACE] = trace
        if request.path != "/healthz":
            who = self.auth.identify(request.headers.get("Authorization", ""))
            if who is None:
                return _json(
                    401,
                    error(
                        "unauthorized", "a valid 'Authorization: Bearer <token>' header is required", trace
                    ),
                    trace,
                )
            request[WHO] = who
            if self.guard is not None:
                self.guard.trust(request.protocol)
        try:
            resp = await handler(request)
        except BadRequest as e:
            return _json(e.status, error(e.reason, e.message, trace, **e.details), trace)
        except web.HTTPRequestEntityTooLarge:
            return _json(
                413,
                error("request_too_large", f"the request body exceeds {self.limits.max_body} bytes", trace),
                trace,
            )
        except web.HTTPMethodNotAllowed as e:
            return _json(
                405,
                error(
                    "method_not_allowed",
                    f"{request.method} is not allowed on {request.path}",
                    trace,
                    allowed=sorted(e.allowed_methods),
                ),
                trace,
            )
        except web.HTTPNotFound:
            return _json(404, error("route_not_found", f"route {request.path!r} not found", trace), trace)
        except web.HTTPException as e:
            return _json(
                e.status, error(e.reason.lower().replace(" ", "_"), e.text or e.reason, trace), trace
            )
        except ConnectionError:
            raise  # the reader left mid-stream: nothing to answer
        except (sqlite3.Error, OSError) as e:  # a full state disk is 507, whichever write met it
            if disk_full(e) and not (request.writer is not None and request.writer.output_size > 0):
                return _json(507, full_disk(f"{type(e).__name__}: {e}", trace), trace)
            return self.bug(request, e, trace)
        except Exception as e:  # a gateway bug: say so as JSON, keep serving
            return self.bug(request, e, trace)
        if not resp.prepared:
            resp.headers.setdefault("X-Trace-Id", trace)
        return resp

    @staticmethod
    def bug(request: web.Request, e: Exception, trace: str) -> web.Response:
        if request.writer is not None and request.writer.output_size > 0:
            raise e  # a streamed answer had begun: a second one would corrupt it; aiohttp aborts
        return _json(500, error("internal_error", f"{type(e).__name__}: {e}", trace), trace)

    # -------------------------------------------------------------------------------- helpers

    async def body(self, request: web.Request) -> Any:
        if request.content_length is not None and request.content_length > self.limits.max_body:
            raise BadRequest(
                "request_too_large",
                f"the request body ({request.content_length} bytes) exceeds {self.limits.max_body} bytes",
                413,
            )
        raw = await request.read()
        if not raw:
            raise BadRequest("empty_body", "a JSON request body is required")
        deep = BadRequest("invalid_json", f"the request body nests deeper than {MAX_DEPTH} levels")
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest("invalid_json", f"the request body is not valid JSON: {e}") from None
        except RecursionError:  # deeper than the parser recurses
            raise deep from None
        if too_deep(value):  # deep enough to recurse later (encoding it, walking it)
            raise deep
        try:  # "\ud800" parses, but no UTF-8 holds it: the store, a file or an argv could not
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise BadRequest(
                "invalid_json", "the request body holds a lone surrogate (\\ud800-\\udfff)"
            ) from None
        return value

    @staticmethod
    def flag(request: web.Request, name: str) -> bool:
        v = request.query.get(name, "").lower()
        if v in TRUE:
            return True
        if v in FALSE:
            return False
        raise BadRequest(f"invalid_{name}", f"{name} must be true or false, got {v!r}")

    @staticmethod
    def who(request: web.Request) -> Identity:
        return request[WHO]

    @staticmethod
    def not_found(job_id: str) -> BadRequest:
        """One answer for a job that does not exist and one that is another caller's."""
        return BadRequest("job_not_found", f"job {job_id!r} not found", 404)

    async def daemon_status(self) -> dict[str, Any] | None:
        client = await self.runner.connect()
        if client is None:
            return None
        if why := self.runner.unready(client):  # a fleet with no node up: say why jobs wait
            self.runner.daemon_error = why
            return None
        try:
            return await client.status()
        except Exception as e:  # the connection broke under us: the next call reconnects
            self.runner.daemon_error = str(e)
            return None

    # ------------------------------------------------------------------------------- handlers

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def env_all(self, request: web.Request) -> web.Response:
        view = await self.env.view(
            await self.daemon_status(), self.runner.daemon_error, self.flag(request, "force")
        )
        return _json(200, {"env": [view]})

    async def env_one(self, request: web.Request) -> web.Response:
        gpu = request.match_info["gpu"]
        if gpu not in self.env.aliases:
            raise BadRequest(
                "environment_not_found",
                f"environment {gpu!r} not found; this gateway has {', '.join(sorted(self.env.aliases))}",
                404,
            )
        view = await self.env.view(
            await self.daemon_status(), self.runner.daemon_error, self.flag(request, "force")
        )
        return _json(200, {**view, "gpu": gpu})

    async def submit(self, request: web.Request, kind: str | None = None) -> web.Response:
        kind = kind or request.match_info["kind"]
        if kind not in self.kinds:
            why = self.missing.get(
                kind, f"unknown job kind {kind!r}; this gateway runs {', '.join(sorted(self.kinds))}"
            )
            raise BadRequest("kind_not_supported", why, 501, kind=kind, supported=sorted(self.kinds))
        req, key, author = self.kinds[kind].validate(await self.body(request))
        if why := low_space(self.store.path.parent, self.min_free):  # jobs accepted keep the rest
            return _json(507, full_disk(why, request[TRACE]), request[TRACE])
        try:  # fields the kinds check name their own error; NaN left in a free-form part is this
            json.dumps(req, allow_nan=False)
        except ValueError:
            raise BadRequest(
                "invalid_request", "the request holds NaN or Infinity, which JSON does not have", 422
            ) from None
        who = self.who(request)
        try:
            job, created = self.store.create(kind, req, request[TRACE], key, author, who.name, who.run_as.uid)
        except TooMany as e:
            raise BadRequest(
                "too_many_jobs",
                f"identity {who.name!r} has {e.queued} job(s) queued and {e.running} running, the most "
                f"this gateway takes from one identity (--max-queued-per-identity {e.cap}); submit again "
                "when one has ended",
                429,
                queued=e.queued,
                running=e.running,
                limit=e.cap,
            ) from None
        except KeyRemoved as e:
            raise BadRequest(
                "job_removed",
                f"idempotency_key {key!r} named job {e.job_id}, removed by the gateway's job retention"
                f" at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(e.removed_at))}; it is not run"
                " again (its result is gone): submit with a new key to run it anew",
                410,
                job_id=e.job_id,
                removed_at=e.removed_at,
                idempotency_key=key,
            ) from None
        if created:
            self.runner.notify()
        resp = _json(202, job)
        resp.headers["Idempotent-Replay"] = "false" if created else "true"
        return resp

    async def submit_eval(self, request: web.Request) -> web.Response:
        return await self.submit(request, "eval")

    async def list_jobs(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        kind, status = q.get("kind"), q.get("status")
        if kind is not None and kind not in KINDS:
            raise BadRequest("invalid_kind", f"unknown job kind {kind!r}", kinds=list(KINDS))
        if status is not None and status not in STATUSES:
            raise BadRequest("invalid_status", f"unknown job status {status!r}", statuses=list(STATUSES))
        try:
            limit = int(q.get("limit", "50"))
        except ValueError:
            raise BadRequest("invalid_limit", "limit must be an integer") from None
        if limit < 1:
            raise BadRequest("invalid_limit", "limit must be at least 1")
        sort = q.get("sort", "-created_at")
        if sort not in ("created_at", "-created_at"):
            raise BadRequest("invalid_sort", "sort must be created_at or -created_at")
        ids = self.store.list_ids(
            self.who(request).name,
            kind,
            status,
            q.get("user"),
            min(limit, 500),
            newest_first=sort != "created_at",
        )
        return await self.views.stream_list(request, ids)

    async def get_job(self, request: web.Request) -> web.StreamResponse:
        job_id = request.match_info["job_id"]
        owner = self.who(request).name
        status = self.store.status(job_id, owner)
        if status is None:
            raise self.not_found(job_id)
        if self.flag(request, "wait"):
            raw = request.query.get("timeout", "30")  # checked whatever the status: 400 either way
            try:
                timeout = float(raw)
            except ValueError:
                raise BadRequest("invalid_timeout", f"timeout must be seconds, got {raw!r}") from None
            if not math.isfinite(timeout) or timeout < 0:
                raise BadRequest("invalid_timeout", "timeout must be a finite number >= 0")
            if status not in TERMINAL and not await self.wait(
                job_id, min(timeout, self.limits.max_wait), request
            ):
                return web.Response(status=499)  # nobody to answer: aiohttp sends nothing
        resp = await self.views.stream_job(request, job_id, owner)
        if resp is None:
            raise self.not_found(job_id)
        return resp

    async def wait(self, job_id: str, timeout: float, request: web.Request | None = None) -> bool:
        """Until the job is terminal, `timeout` passes or the gateway closes; False (at once, within
        CLIENT_CHECK) when the request's client has gone: aiohttp does not cancel a handler whose
        connection closed, and its poll would hold a waiter for the rest of `timeout`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        status = self.store.status(job_id)
        while status is not None and status not in TERMINAL and not self.closing:
            fut: asyncio.Future[None] = loop.create_future()
            self.waiters.setdefault(job_id, set()).add(fut)
            try:
                while not fut.done():
                    left = deadline - loop.time()
                    if left <= 0:
                        return True
                    await asyncio.wait([fut], timeout=min(left, CLIENT_CHECK))
                    if request is not None and client_gone(request):
                        self.polls_left += 1
                        return False
            finally:
                waiting = self.waiters.get(job_id)
                if waiting is not None:
                    waiting.discard(fut)
                    if not waiting:
                        del self.waiters[job_id]
            status = self.store.status(job_id)
        return True

    async def cancel(self, request: web.Request) -> web.StreamResponse:
        job_id = request.match_info["job_id"]
        owner = self.who(request).name
        if await self.runner.cancel(job_id, owner) is None:
            raise self.not_found(job_id)
        resp = await self.views.stream_job(request, job_id, owner)
        if resp is None:
            raise self.not_found(job_id)
        return resp


def make_app(gw: Gateway) -> web.Application:
    app = web.Application(middlewares=[gw.middleware], client_max_size=gw.limits.max_body)
    app.add_routes(
        [
            web.get("/healthz", gw.healthz),
            web.get("/v1/env", gw.env_all),
            web.get("/v1/env/{gpu}", gw.env_one),
            web.get("/v1/jobs", gw.list_jobs),
            web.post("/v1/jobs/{job_id}/cancel", gw.cancel),
            web.get("/v1/jobs/{job_id}", gw.get_job),
            web.post("/v1/jobs/{kind}", gw.submit),
            web.get("/v1/evals/{job_id}", gw.get_job),
            web.post("/v1/evals", gw.submit_eval),
        ]
    )
    return app
