"""The console's HTTP side (aiohttp): the page and its JSON API, and the guards around
them.

Security choices (docs/console.md says why):

- read-only unless started with ``--allow-actions``; then a POST must carry the
  per-process token the page holds (``X-Cgroupd-Token``), an ``Origin`` equal to the
  address it was sent to, and a JSON body: a page of another site can neither read the
  token nor send such a request (no CORS headers are ever given);
- the ``Host`` header must name this console (a loopback name, the listen address, or an
  ``--allow-host``): DNS rebinding cannot turn another site into a reader of the API;
- a strict Content-Security-Policy (only this origin's script and style, no framing);
- nothing secret in the page or the API: no credentials, the server shown as
  scheme://host:port only, no message payloads.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import secrets
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

from aiohttp import web

import cgroupd
from cgroupd import admin
from cgroupd.cli.observe import problem
from cgroupd.console._actions import run_action
from cgroupd.console._watch import GroupWatch, Shared
from cgroupd.nats import events
from cgroupd.nats.jetstream import JetStream

#: Seconds a listing of the groups is reused (it reads every group record).
GROUPS_TTL = 30.0
#: The page's files, shipped as package data.
STATIC = {"console.js": "text/javascript", "console.css": "text/css"}
#: Header a POST carries the page's token in.
TOKEN_HEADER = "X-Cgroupd-Token"
_LOOPBACK = ("localhost", "127.0.0.1", "::1")
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True)
class ConsoleOptions:
    """How a console serves."""

    #: Streams whose groups are shown; empty: every group the credentials can read.
    streams: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8480
    #: Seconds between status reads of a watched group (and between page refreshes).
    interval: float = 2.0
    allow_actions: bool = False
    #: More names the Host header may carry (a DNS name the console is reached by).
    allowed_hosts: tuple[str, ...] = ()
    #: Seconds each status read listens for instances answering discovery.
    discovery_wait: float = 0.25

    def __post_init__(self) -> None:
        if not self.interval > 0:
            raise ValueError(f"interval {self.interval} must be positive")


def _is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "*")


def allowed_host_names(options: ConsoleOptions) -> frozenset[str] | None:
    """Host header names served; None: any (a wildcard listen address and no
    ``--allow-host``: the console cannot know the names it is reached by)."""
    if _is_wildcard(options.host) and not options.allowed_hosts:
        return None
    names = {*_LOOPBACK, *(h.lower() for h in options.allowed_hosts)}
    if not _is_wildcard(options.host):
        names.add(options.host.lower().strip("[]"))
    return frozenset(names)


def _host_name(request: web.Request) -> str | None:
    """The name in the Host header, without its port (``[::1]:8480`` → ``::1``)."""
    host = request.headers.get("Host", "").strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else None
    return host.rpartition(":")[0] if host.count(":") == 1 else (host or None)


def server_label(js: JetStream) -> str:
    """The server the console is connected to as scheme://host:port: never its user
    info (a password or token may be written in a URL)."""
    url = getattr(js.nc, "connected_url", None)
    if url is None or not getattr(url, "hostname", None):
        return "-"
    host = url.hostname
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass
    return f"{url.scheme}://{host}:{url.port or 4222}"


def _load(name: str) -> str:
    return (resources.files("cgroupd.console") / "static" / name).read_text("utf-8")


class Console:
    """One console process: the shared reads and the web application."""

    def __init__(self, js: JetStream, options: ConsoleOptions) -> None:
        self.js = js
        self.options = options
        #: The per-process token a POST must carry (in the page only with actions on).
        self.token = secrets.token_urlsafe(32)
        self.groups: Shared[list[dict[str, str]]] = Shared(self._list_groups, GROUPS_TTL)
        self._watches: dict[tuple[str, str], GroupWatch] = {}
        self._starting: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._hosts = allowed_host_names(options)
        self._files = {name: _load(name) for name in STATIC}
        self._index = _load("index.html")

    # -- reads --------------------------------------------------------------------------
    async def _list_groups(self) -> list[dict[str, str]]:
        every = await admin.list_every_group(self.js)
        return [{"stream": s, "group": g, "type": kind} for s, g, kind in every
                if not self.options.streams or s in self.options.streams]

    async def watch(self, stream: str, group: str) -> GroupWatch | None:
        """The group's shared watch, started on first use; None when it is not one of
        the groups shown."""
        key = (stream, group)
        if key not in self._watches:
            listed = await self.groups.get()
            if not any((g["stream"], g["group"]) == key for g in listed):
                return None
            if key not in self._watches:
                w = GroupWatch(self.js, stream, group, self.options.interval,
                               self.options.discovery_wait)
                self._watches[key] = w
                self._starting[key] = asyncio.ensure_future(w.start())
        starting = self._starting[key]
        try:
            await asyncio.shield(starting)
        except Exception:
            if self._starting.get(key) is starting:  # the next request tries again
                await self._watches.pop(key).close()
                del self._starting[key]
            raise
        return self._watches[key]

    @property
    def reads(self) -> int:
        """Status reads made so far, over every group (for tests and the page)."""
        return sum(w.status.reads for w in self._watches.values())

    # -- HTTP ---------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=64 * 1024)
        app.router.add_get("/", self._page)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/groups", self._api_groups)
        app.router.add_get("/api/groups/{stream}/{group}", self._api_group)
        app.router.add_post("/api/groups/{stream}/{group}/actions/{action}", self._api_action)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self._hosts is not None and _host_name(request) not in self._hosts:
            return _error(421, "this console does not serve that Host name "
                               "(start it with --allow-host NAME)")
        try:
            response: web.StreamResponse = await handler(request)
        except web.HTTPException as exc:
            response = _error(exc.status, exc.reason)
        response.headers.update(_HEADERS)
        return response

    async def _page(self, request: web.Request) -> web.Response:
        page = (self._index
                .replace("__CGROUPD_TOKEN__", self.token if self.options.allow_actions else "")
                .replace("__CGROUPD_VERSION__", cgroupd.__version__))
        return web.Response(text=page, content_type="text/html", charset="utf-8")

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self._files:
            return _error(404, "no such file")
        return web.Response(text=self._files[name], content_type=STATIC[name],
                            charset="utf-8")

    async def _api_groups(self, request: web.Request) -> web.Response:
        try:
            listed = await self.groups.get()
        except Exception as exc:  # noqa: BLE001 - shown in the page
            return _error(502, problem(exc))
        return web.json_response({
            "groups": listed, "interval": self.options.interval,
            "actions": self.options.allow_actions, "server": server_label(self.js),
            "streams": list(self.options.streams), "version": cgroupd.__version__})

    async def _api_group(self, request: web.Request) -> web.Response:
        stream, group = request.match_info["stream"], request.match_info["group"]
        try:
            after = int(request.query.get("after", "0"))
        except ValueError:
            return _error(400, "after: an event number")
        try:
            w = await self.watch(stream, group)
            if w is None:
                return _error(404, f"no consumer group {group!r} on stream {stream!r} here")
            data = dict(await w.status.get())
        except Exception as exc:  # noqa: BLE001 - shown in the page, asked again next time
            return _error(502, problem(exc))
        data["events"] = w.timeline.after(after)
        data["now"] = events.iso(time.time())
        return web.json_response(data)

    def _refuse_post(self, request: web.Request) -> web.Response | None:
        """Why a POST is not an action this console's own page asked for, if it is not."""
        if not self.options.allow_actions:
            return _error(403, "actions are disabled: start the console with "
                               "--allow-actions")
        given = request.headers.get(TOKEN_HEADER, "")
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return _error(403, "missing or wrong console token (reload the page)")
        origin = (request.headers.get("Origin") or "").lower()
        # https: behind a proxy that terminates TLS and passes the Host header on.
        if origin not in (f"http://{request.host}".lower(), f"https://{request.host}".lower()):
            return _error(403, "cross-origin request refused")
        if request.headers.get("Sec-Fetch-Site", "same-origin") != "same-origin":
            return _error(403, "cross-site request refused")
        if request.content_type != "application/json":
            return _error(415, "send JSON")
        return None

    async def _api_action(self, request: web.Request) -> web.Response:
        refused = self._refuse_post(request)
        if refused is not None:
            return refused
        stream, group = request.match_info["stream"], request.match_info["group"]
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body is not a JSON object")
        w = await self.watch(stream, group)
        if w is None:
            return _error(404, f"no consumer group {group!r} on stream {stream!r} here")
        action = request.match_info["action"]
        outcome = await run_action(self.js, stream, group, action, body)
        if not outcome.ok:
            w.timeline.add("console", f"{action} refused: {outcome.message}")
            return _error(outcome.status, outcome.message)
        if action != "replay-plan":
            w.timeline.add("console", f"{action} done from the console: "
                                      f"{outcome.message.splitlines()[0]}")
            w.status.expire()  # the next refresh shows the change
        return web.json_response({"message": outcome.message, "data": outcome.data})

    async def close(self) -> None:
        for w in self._watches.values():
            await w.close()


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=json.dumps({"error": message}),
                        content_type="application/json")
