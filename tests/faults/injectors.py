"""Fault injectors: signals, nats-server restarts, cluster node faults, network cuts.

Process signals are :meth:`tests.faults.runner.JoinProc.signal`. Server operations of
:mod:`tests.support.natsserver` block (they poll with ``time.sleep``), so the async wrappers here
run them in a thread: the publisher and the test's own client keep running meanwhile.

:class:`VethNamespace` cuts one member process off the network: it runs inside a network
namespace joined to the host by a veth pair, with both ends addressed from a private /30
picked for this test only (checked against every address and route on the host);
nats-server listens on the host end. Taking the host end down cuts the namespace off
(the host end's local address keeps working for host-side clients); bringing it up heals.
If namespaces cannot be made, :class:`NetnsUnavailable` is raised and the test fails.

:class:`HoldingProxy` sits between in-process clients and nats-server on loopback: it can
hold traffic in one direction (bytes kept, not forwarded: a reply or an ack "in flight"),
release it, or cut every connection (what it held is lost): the wire faults behind lost
acks and unanswered double-acks, made deterministic.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import random
import secrets
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.support.natsserver import NatsCluster, NatsServer
from tests.support.polling import eventually

#: Prefix of every namespace and interface name created here (the leak check uses it).
NAME_PREFIX = "cgf"
#: The private range test subnets are drawn from.
POOL = ipaddress.IPv4Network("10.213.0.0/16")


class NetnsUnavailable(RuntimeError):
    """Network namespaces or veth pairs cannot be created here."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and result.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed ({result.returncode}): "
                               f"{result.stderr.strip() or result.stdout.strip()}")
    return result


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network already addressed or routed on the host (any table)."""
    nets: list[ipaddress.IPv4Network] = []
    addrs = json.loads(_ip("-j", "addr").stdout or "[]")
    for link in addrs:
        for a in link.get("addr_info", []):
            if a.get("family") == "inet":
                nets.append(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}",
                                                  strict=False))
    routes = json.loads(_ip("-j", "route", "show", "table", "all").stdout or "[]")
    for r in routes:
        dst = r.get("dst", "")
        if dst and dst != "default" and ":" not in dst:
            try:
                nets.append(ipaddress.IPv4Network(dst, strict=False))
            except ValueError:
                continue
    return nets


def pick_subnet() -> ipaddress.IPv4Network:
    """A /30 of :data:`POOL` that overlaps nothing on the host."""
    used = _used_networks()
    rng = random.Random()
    for _ in range(200):
        base = int(POOL.network_address) + 4 * rng.randrange(1, POOL.num_addresses // 4 - 1)
        net = ipaddress.IPv4Network(f"{ipaddress.IPv4Address(base)}/30")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise NetnsUnavailable(f"no free /30 in {POOL}")


class VethNamespace:
    """A network namespace for one member process, wired to the host by a veth pair."""

    def __init__(self) -> None:
        token = secrets.token_hex(3)
        self.name = f"{NAME_PREFIX}{token}"
        self.host_if = f"{NAME_PREFIX}h{token}"  # <= 15 characters (IFNAMSIZ)
        self.ns_if = f"{NAME_PREFIX}n{token}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.host_addr = ""
        self.ns_addr = ""
        self._created_ns = False
        self._created_link = False

    def create(self) -> VethNamespace:
        """Make the namespace and the link; NetnsUnavailable (with why) if impossible."""
        self.subnet = pick_subnet()
        host, peer = list(self.subnet.hosts())
        self.host_addr, self.ns_addr = str(host), str(peer)
        MADE.update((self.name, self.host_if))
        _ip("netns", "add", self.name)
        self._created_ns = True
        _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        self._created_link = True
        _ip("link", "set", self.ns_if, "netns", self.name)
        _ip("addr", "add", f"{self.host_addr}/30", "dev", self.host_if)
        _ip("link", "set", self.host_if, "up")
        _ip("-n", self.name, "addr", "add", f"{self.ns_addr}/30", "dev", self.ns_if)
        _ip("-n", self.name, "link", "set", self.ns_if, "up")
        _ip("-n", self.name, "link", "set", "lo", "up")
        return self

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        """Take the host end down: the namespace loses its only link."""
        _ip("link", "set", self.host_if, "down")

    def heal(self) -> None:
        _ip("link", "set", self.host_if, "up")

    def reachable(self, port: int) -> bool:
        """Whether a TCP connect from inside the namespace to the host end succeeds."""
        code = ("import socket,sys\n"
                f"s=socket.create_connection(({self.host_addr!r},{port}),timeout=0.5)\n"
                "s.close()\n")
        r = subprocess.run(["ip", "netns", "exec", self.name, "python3", "-c", code],
                           capture_output=True, timeout=10)
        return r.returncode == 0

    def close(self) -> None:
        """Kill anything still running inside, delete the link and the namespace."""
        if self._created_ns:
            pids = _ip("netns", "pids", self.name, check=False).stdout.split()
            for pid in pids:  # only processes of this test can be in this namespace
                subprocess.run(["kill", "-CONT", pid], capture_output=True)
                subprocess.run(["kill", "-KILL", pid], capture_output=True)
        if self._created_link:
            _ip("link", "del", self.host_if, check=False)
        if self._created_ns:
            _ip("netns", "del", self.name, check=False)
        self._created_ns = self._created_link = False

    def __enter__(self) -> VethNamespace:
        try:
            return self.create()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def namespace_for_test() -> Iterator[VethNamespace]:
    """A veth-wired namespace for one test, removed afterwards. A machine that cannot make
    one fails the test with why (never a skip: these tests guard exclusivity)."""
    ns = VethNamespace()
    try:
        ns.create()
    except NetnsUnavailable as exc:
        ns.close()
        pytest.fail(f"this test needs network namespaces and veth pairs (root): {exc}")
    try:
        yield ns
    finally:
        ns.close()


#: Names of the namespaces and host links this process made, so the leak check sees only
#: its own (another test run on the same machine may hold namespaces of its own).
MADE: set[str] = set()


def leftovers() -> list[str]:
    """Namespaces and links made by this process that still exist."""
    out = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()
           if line.split() and line.split()[0] in MADE]
    for link in json.loads(_ip("-j", "link", check=False).stdout or "[]"):
        if str(link.get("ifname", "")) in MADE:
            out.append(link["ifname"])
    return out


# -- servers -------------------------------------------------------------------------
async def restart_server(server: NatsServer, *, graceful: bool,
                         down_for: float = 0.0) -> float:
    """Stop nats-server (SIGTERM or SIGKILL), start it on the same store, wait until ready.

    ``down_for`` keeps it down that long (the outage clients see). Returns the outage.
    """
    began = time.monotonic()
    await asyncio.to_thread(server.stop if graceful else server.kill)
    if down_for:
        await asyncio.sleep(down_for)  # the fault's duration, not a synchronisation
    await asyncio.to_thread(server.start)
    await asyncio.to_thread(server.wait_ready, 30.0)
    return time.monotonic() - began


async def stream_leader(cluster: NatsCluster, stream: str) -> int:
    return await asyncio.to_thread(cluster.stream_leader, stream, timeout=30.0)


async def kill_node(cluster: NatsCluster, i: int) -> None:
    await asyncio.to_thread(cluster.kill, i)


async def restart_node(cluster: NatsCluster, i: int, streams: tuple[str, ...] = ()) -> None:
    """Start node ``i`` again and wait until it is healthy and ``streams`` are in sync."""
    await asyncio.to_thread(cluster.restart, i, 60.0)
    for stream in streams:
        await asyncio.to_thread(cluster.wait_stream_synced, stream, timeout=60.0)


async def rolling_restart(cluster: NatsCluster, streams: tuple[str, ...]) -> list[float]:
    """SIGTERM and restart each node in turn, waiting for the streams to catch up before
    the next one. Returns how long each node took."""
    took = []
    for i in range(len(cluster)):
        began = time.monotonic()
        await asyncio.to_thread(cluster.stop, i)
        await restart_node(cluster, i, streams)
        took.append(time.monotonic() - began)
    return took


# -- the wire ------------------------------------------------------------------------
class HoldingProxy:
    """A TCP proxy to one nats-server whose traffic can be held, released or cut.

    ``hold_up`` holds what clients send (``up``), ``hold_down`` what the server sends,
    ``refuse`` turns new connections away;
    :meth:`release` forwards what was held; :meth:`cut` closes every connection and drops
    what was held (clients reconnect through the proxy). :meth:`wait_seen` waits until
    a byte pattern went up (or was held going up) a number of times.
    """

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.hold_up = False
        self.hold_down = False
        #: Turn new connections away (a server that cannot be reached for a while).
        self.refuse = False
        self._held: dict[str, list[tuple[asyncio.StreamWriter, bytes]]] = {"up": [], "down": []}
        self._seen_up = bytearray()
        self._server: asyncio.Server | None = None
        self._links: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def __aenter__(self) -> HoldingProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await self.cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        if self.refuse:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        self._links.append((writer, up_writer))
        for args in ((reader, up_writer, "up"), (up_reader, writer, "down")):
            task = asyncio.create_task(self._pump(*args))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    direction: str) -> None:
        try:
            while data := await reader.read(65536):
                if direction == "up":
                    self._seen_up += data
                if self.hold_up if direction == "up" else self.hold_down:
                    self._held[direction].append((writer, data))
                    continue
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def release(self) -> None:
        """Stop holding; forward what was held, in order."""
        self.hold_up = self.hold_down = False
        for direction in ("up", "down"):
            held, self._held[direction] = self._held[direction], []
            for writer, data in held:
                if not writer.is_closing():
                    writer.write(data)
                    with contextlib.suppress(ConnectionError, OSError):
                        await writer.drain()

    async def cut(self) -> None:
        """Close every connection; whatever was held is lost."""
        self.hold_up = self.hold_down = False
        self._held = {"up": [], "down": []}
        links, self._links = self._links, []
        for client, upstream in links:
            for writer in (client, upstream):
                writer.close()

    def seen(self, pattern: bytes) -> int:
        return self._seen_up.count(pattern)

    async def wait_seen(self, pattern: bytes, count: int, timeout: float = 10.0) -> None:
        await eventually(lambda: self.seen(pattern) >= count, timeout, 0.005,
                         f"{count} x {pattern!r} sent through the proxy")
