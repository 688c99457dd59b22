"""The operator console: server-rendered pages over the projections, the event store and the
ledger, for operators only (aiohttp, as the gateway; Jinja2 with autoescape; no script but the
console's own ``static/console.js``).

It never shares a port with the tenant-facing gateway: ``loraplane console`` (and ``serve
--console-port``) bind it on loopback unless told otherwise. Access (:mod:`.access`): the
console token, traded at ``/login`` for an HttpOnly, SameSite=Strict session cookie; a bearer
header with the console token works for the read-only pages and exports (scripts). A tenant API
key is refused like any other wrong credential. A state change (pausing, resuming or aborting a
rollout) is a POST with the session's CSRF token and ``confirm=yes``, reached through a
confirmation page, and calls the same ``RolloutDesk`` method as the CLI verb.

Every response carries a strict Content-Security-Policy (no inline script, nothing from another
origin, no framing). Reads that touch the database run in worker threads, off the event loop.
"""

from __future__ import annotations

import asyncio
import csv
import datetime as dt
import io
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import jinja2
from aiohttp import web

from control.app.integrity import AuditSeal
from control.app.rollouts import RolloutDesk
from control.console import reads
from control.console.access import COOKIE, SESSION_TTL_S, Gatekeeper, Session
from control.console.charts import rollout_charts
from control.contracts.digests import DigestError, check_digest
from control.contracts.host_status import REPORT_INTERVAL_S, STALE_AFTER_S
from control.domain import DomainError, NotFound
from projections.routing import RoutingView

if TYPE_CHECKING:
    from control.app.registry import Registry

HERE = Path(__file__).parent
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
       "frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "X-Frame-Options": "DENY", "Cache-Control": "no-store",
           # same-origin, not no-referrer: under no-referrer Chromium sends ``Origin: null`` with
           # the console's own forms, and the origin check below would refuse them
           "Referrer-Policy": "same-origin"}
REFRESH_S = 2  # live fragments: the interval each page states
ACTIONS = {"pause": "RolloutPaused", "resume": "RolloutResumed", "abort": "RolloutAborted"}
ACTIONS_DONE = {"pause": "paused", "resume": "resumed", "abort": "aborted"}
PUBLIC = ("/login", "/static/")
SESSION_KEY = web.RequestKey("console_session", Session)  # the guard leaves it there
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}ms" if v < 1 else f"{v:.2f}s"


class Console:
    """The console's state: the registry it reads, its gatekeeper, and the last audit check."""

    def __init__(self, registry: Registry, *, actor: str, verify_every_s: float = 30.0,
                 refresh_s: int = REFRESH_S) -> None:
        self.reg = registry
        self.desk: RolloutDesk = RolloutDesk(registry)
        self.seal: AuditSeal = AuditSeal.for_registry(registry)
        self.gate = Gatekeeper(registry.settings.home)
        self.actor = f"{actor}@console"  # recorded on the events the console's buttons make
        self.verify_every_s = verify_every_s
        self.refresh_s = refresh_s
        self._audit: dict[str, Any] | None = None
        self._audit_lock = asyncio.Lock()
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,  # every tenant-controlled string is escaped, in every template
            undefined=jinja2.StrictUndefined)
        self.env.filters["pct"] = _pct
        self.env.filters["secs"] = _secs

    # -- rendering ------------------------------------------------------------------------------

    def page(self, request: web.Request, template: str, status: int = 200,
             **context: Any) -> web.Response:
        session: Session | None = request.get(SESSION_KEY)
        context.setdefault("error", None)
        context.setdefault("title", template.split(".")[0].replace("_", " "))
        html = self.env.get_template(template).render(
            csrf=session.csrf if session else None, interval_s=self.refresh_s, **context)
        return web.Response(text=html, content_type="text/html", status=status)

    # -- access -----------------------------------------------------------------------------------

    @web.middleware
    async def guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await self._guarded(request, handler)
        except web.HTTPException as e:  # redirects and refusals carry the headers too
            e.headers.update(HEADERS)
            raise
        response.headers.update(HEADERS)
        return response

    async def _guarded(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "POST":
            origin = request.headers.get("Origin")
            if origin is not None and origin != f"{request.scheme}://{request.host}":
                raise web.HTTPForbidden(text="cross-origin form refused")
        if request.path.startswith(PUBLIC):
            return await handler(request)
        session = self.gate.session(request.cookies.get(COOKIE))
        if session is None:
            auth = request.headers.get("Authorization", "")
            bearer = auth[7:] if auth.lower().startswith("bearer ") else ""
            if bearer and request.method == "GET" and self.gate.is_token(bearer):
                return await handler(request)
            if request.method == "GET" and not bearer and "format" not in request.query \
                    and not request.path.endswith("/live"):
                raise web.HTTPSeeOther("/login")
            raise web.HTTPUnauthorized(text="the console needs the operator's console token")
        request[SESSION_KEY] = session
        if request.method == "POST":
            form = await request.post()
            if not Gatekeeper.csrf_ok(session, str(form.get("csrf", ""))):
                raise web.HTTPForbidden(text="missing or wrong CSRF token")
        return await handler(request)

    async def login_form(self, request: web.Request) -> web.Response:
        return self.page(request, "login.html", title="log in")

    async def login(self, request: web.Request) -> web.Response:
        form = await request.post()
        if not self.gate.is_token(str(form.get("token", ""))):
            return self.page(request, "login.html", status=401, title="log in",
                             error="That is not the console token.")
        response = web.HTTPSeeOther("/adapters")
        response.set_cookie(COOKIE, self.gate.new_session(), httponly=True, samesite="Strict",
                            max_age=SESSION_TTL_S, path="/",
                            secure=request.scheme == "https")
        raise response

    async def logout(self, request: web.Request) -> web.Response:
        response = web.HTTPSeeOther("/login")
        response.del_cookie(COOKIE, path="/")
        raise response

    # -- pages ------------------------------------------------------------------------------------

    async def home(self, request: web.Request) -> web.Response:
        raise web.HTTPSeeOther("/adapters")

    async def adapters(self, request: web.Request) -> web.Response:
        rows = await asyncio.to_thread(
            lambda: RoutingView(self.reg.follower.engine).adapters(None))
        return self.page(request, "adapters.html", adapters=rows, title="adapters")

    async def adapter(self, request: web.Request) -> web.Response:
        digest = _digest(request.match_info["digest"])

        def read() -> tuple[Any, list[dict[str, Any]]]:
            return (RoutingView(self.reg.follower.engine).adapter(digest),
                    reads.timeline(self.reg, digest))

        row, events = await asyncio.to_thread(read)
        if row is None and not events:
            raise web.HTTPNotFound(text="no adapter with this digest")
        return self.page(request, "adapter.html", digest=digest, row=row, events=events,
                         title=f"adapter {digest[:19]}")

    def _rollout_rows(self) -> list[dict[str, Any]]:
        rows = reads.rollouts(self.reg)
        for r in rows:
            r["started"] = reads.iso(r["started_at"])
        return rows

    async def rollouts(self, request: web.Request) -> web.Response:
        rows = await asyncio.to_thread(self._rollout_rows)
        return self.page(request, "rollouts.html", rollouts=rows, title="rollouts")

    async def rollouts_live(self, request: web.Request) -> web.Response:
        rows = await asyncio.to_thread(self._rollout_rows)
        return self.page(request, "rollouts_table.html", rollouts=rows)

    async def _detail(self, request: web.Request) -> dict[str, Any]:
        alias = request.match_info["alias"]
        number = request.query.get("number")
        try:
            n = int(number) if number else None
            return await asyncio.to_thread(reads.rollout_detail, self.desk, alias, n)
        except (NotFound, ValueError):
            raise web.HTTPNotFound(text="no such rollout") from None

    async def rollout(self, request: web.Request) -> web.Response:
        r = await self._detail(request)
        return self.page(request, "rollout.html", r=r, charts=rollout_charts(r["windows"]),
                         title=f"rollout {r['alias']} #{r['number']}")

    async def rollout_live(self, request: web.Request) -> web.Response:
        r = await self._detail(request)
        return self.page(request, "rollout_live.html", r=r, charts=rollout_charts(r["windows"]))

    def _not_now(self, request: web.Request, r: dict[str, Any], action: str
                  ) -> web.Response | None:
        """The rollout page with a refusal, when ``r``'s status does not allow ``action`` (a
        finished rollout allows none); None when it does. A rollout that allows one is the
        alias's current rollout (an alias runs one at a time), the one the desk moves."""
        if action in r["actions"]:
            return None
        return self.page(request, "rollout.html", status=409, r=r,
                         error=f"rollout #{r['number']} of {r['alias']} is "
                               f"{r['status'].replace('_', ' ')}: "
                               f"it cannot be {ACTIONS_DONE[action]}",
                         charts=rollout_charts(r["windows"]), title="rollout")

    async def confirm(self, request: web.Request) -> web.Response:
        action = request.query.get("action", "")
        if action not in ACTIONS:
            raise web.HTTPBadRequest(text="action is pause, resume or abort")
        r = await self._detail(request)
        refused = self._not_now(request, r, action)
        if refused is not None:
            return refused
        return self.page(request, "confirm.html", action=action, alias=r["alias"],
                         number=r["number"], event=ACTIONS[action], title=f"confirm {action}")

    async def act(self, request: web.Request) -> web.Response:
        alias, action = request.match_info["alias"], request.match_info["action"]
        form = await request.post()
        if action not in ACTIONS:
            raise web.HTTPNotFound(text="no such action")
        if form.get("confirm") != "yes":
            raise web.HTTPBadRequest(text="confirm the action on its confirmation page")
        reason = str(form.get("reason", "")).strip()
        if action == "abort" and not reason:
            raise web.HTTPBadRequest(text="an abort needs a reason")
        if form.get("number"):  # the rollout its confirmation page named: still movable?
            try:
                r = await asyncio.to_thread(reads.rollout_detail, self.desk, alias,
                                            int(str(form["number"])))
            except (NotFound, ValueError):
                raise web.HTTPNotFound(text="no such rollout") from None
            refused = self._not_now(request, r, action)
            if refused is not None:
                return refused
        move = getattr(self.desk, action)
        try:
            await asyncio.to_thread(move, alias, reason, actor=self.actor)
        except DomainError as e:
            r = await self._detail(request)
            return self.page(request, "rollout.html", status=409, r=r, error=str(e),
                             charts=rollout_charts(r["windows"]), title="rollout")
        raise web.HTTPSeeOther(f"/rollouts/{alias}")

    async def hosts(self, request: web.Request) -> web.Response:
        rows = await asyncio.to_thread(reads.hosts, self.reg)
        template = "hosts_table.html" if request.path.endswith("/live") else "hosts.html"
        return self.page(request, template, hosts=rows, title="hosts",
                         report_s=f"{REPORT_INTERVAL_S:g}", stale_s=f"{STALE_AFTER_S:g}")

    async def incidents(self, request: web.Request) -> web.StreamResponse:
        q = {k: request.query.get(k, "").strip() or None
             for k in ("adapter", "base", "release", "training_data_version", "tenant", "since",
                       "until", "include_refused")}
        subjects = [k for k in ("adapter", "base", "release", "training_data_version") if q[k]]
        fmt = request.query.get("format")
        if not subjects:
            return self.page(request, "incidents.html", q=q, rows=None, qs="",
                             title="incidents")
        try:
            if len(subjects) != 1:
                raise ValueError("give one of adapter, base, release, training data")
            args = {k: (check_digest(q[k]) if k != "training_data_version" else q[k])  # type: ignore[arg-type]
                    for k in subjects}
            rows = await asyncio.to_thread(
                lambda: reads.incident_rows(self.reg, since=_time(q["since"]),
                                            until=_time(q["until"]),
                                            include_refused=bool(q["include_refused"]), **args))
        except (ValueError, DigestError) as e:
            if fmt:
                raise web.HTTPBadRequest(text=str(e)) from None
            return self.page(request, "incidents.html", status=400, q=q, rows=None, qs="",
                             error=str(e), title="incidents")
        if q["tenant"]:
            rows = [r for r in rows if r["tenant"] == q["tenant"]]
        if fmt in ("json", "csv"):
            body = json.dumps(rows, default=str) if fmt == "json" else to_csv(rows)
            return web.Response(
                text=body, content_type="application/json" if fmt == "json" else "text/csv",
                headers={"Content-Disposition": f"attachment; filename=incident.{fmt}"})
        qs = urlencode({k: v for k, v in q.items() if v})
        return self.page(request, "incidents.html", q=q, rows=rows, qs=qs, title="incidents")

    async def audit(self, request: web.Request) -> web.Response:
        async with self._audit_lock:  # one verification at a time, however many viewers
            if self._audit is None or time.time() - self._audit["verified_at"] \
                    >= self.verify_every_s:
                self._audit = await asyncio.to_thread(reads.audit_status, self.reg, self.seal)
        a = self._audit
        return self.page(request, "audit.html", a=a, verified=reads.iso(a["verified_at"]),
                         every_s=self.verify_every_s, title="audit")

    # -- the app ----------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.guard], client_max_size=64 * 1024)
        app.add_routes([
            web.get("/login", self.login_form), web.post("/login", self.login),
            web.post("/logout", self.logout), web.get("/", self.home),
            web.get("/adapters", self.adapters), web.get("/adapters/{digest}", self.adapter),
            web.get("/rollouts", self.rollouts), web.get("/rollouts/live", self.rollouts_live),
            web.get("/rollouts/{alias}", self.rollout),
            web.get("/rollouts/{alias}/live", self.rollout_live),
            web.get("/rollouts/{alias}/confirm", self.confirm),
            web.post("/rollouts/{alias}/{action}", self.act),
            web.get("/hosts", self.hosts), web.get("/hosts/live", self.hosts),
            web.get("/incidents", self.incidents), web.get("/audit", self.audit),
            web.static("/static", HERE / "static"),
        ])
        return app


def to_csv(rows: list[dict[str, Any]]) -> str:
    """The rows as CSV, one column per field of the JSON rows, in their order."""
    out = io.StringIO()
    if rows:
        w = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    return out.getvalue()


def _digest(value: str) -> str:
    try:
        return check_digest(value)
    except DigestError:
        raise web.HTTPBadRequest(text="expected a digest like sha256:<64 hex>") from None


def _time(value: str | None) -> float | None:
    if not value:
        return None
    t = dt.datetime.fromisoformat(value)  # ValueError: the page says so
    return (t if t.tzinfo else t.replace(tzinfo=dt.UTC)).timestamp()
