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


def pick_subnet(prefixlen: int = 30) -> ipaddress.IPv4Network:
    """A subnet of :data:`POOL` (a /30 unless told) that overlaps nothing on the host."""
    used = _used_networks()
    rng = random.Random()
    size = 2 ** (32 - prefixlen)
    for _ in range(200):
        base = int(POOL.network_address) + size * rng.randrange(
            1, POOL.num_addresses // size - 1)
        net = ipaddress.IPv4Network(f"{ipaddress.IPv4Address(base)}/{prefixlen}")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise NetnsUnavailable(f"no free /{prefixlen} in {POOL}")


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


class BridgedNamespaces:
    """Several network namespaces on one host bridge: a small LAN of machines.

    Each namespace gets a veth pair whose host end is a port of the bridge; the bridge
    holds the host's address, so host-side clients reach every namespace and the
    namespaces reach each other (one /29 picked for this test only). :meth:`cut` makes
    two of them unreachable from each other and nothing else: a blackhole route to the
    other's address inside each (sends are dropped, established TCP connections stay
    open and silent, as behind a broken switch port), :meth:`heal` removes the routes.
    """

    def __init__(self, count: int) -> None:
        if not 1 <= count <= 5:
            raise ValueError("a /29 holds the host and at most 5 namespaces")
        token = secrets.token_hex(3)
        self.bridge = f"{NAME_PREFIX}b{token}"
        self.names = [f"{NAME_PREFIX}{i}{token}" for i in range(count)]
        self.host_ifs = [f"{NAME_PREFIX}h{i}{token}" for i in range(count)]
        self.ns_ifs = [f"{NAME_PREFIX}n{i}{token}" for i in range(count)]
        self.host_addr = ""
        self.addrs: list[str] = []
        self.prefixlen = 29
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name), in order
        self._cuts: set[tuple[int, int]] = set()

    def create(self) -> BridgedNamespaces:
        """Make the bridge, the namespaces and their links; NetnsUnavailable if impossible."""
        subnet = pick_subnet(self.prefixlen)
        hosts = [str(h) for h in subnet.hosts()]
        self.host_addr, self.addrs = hosts[0], hosts[1:1 + len(self.names)]
        MADE.update((self.bridge, *self.names, *self.host_ifs))
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("addr", "add", f"{self.host_addr}/{self.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for name, host_if, ns_if, addr in zip(self.names, self.host_ifs, self.ns_ifs,
                                              self.addrs, strict=True):
            _ip("netns", "add", name)
            self._made.append(("netns", name))
            _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
            self._made.append(("link", host_if))
            _ip("link", "set", ns_if, "netns", name)
            _ip("link", "set", host_if, "master", self.bridge)
            _ip("link", "set", host_if, "up")
            _ip("-n", name, "addr", "add", f"{addr}/{self.prefixlen}", "dev", ns_if)
            _ip("-n", name, "link", "set", ns_if, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        return self

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a process inside namespace ``i``."""
        return ["ip", "netns", "exec", self.names[i]]

    def cut(self, a: int, b: int) -> None:
        """Blackhole the way between namespaces ``a`` and ``b`` (both directions)."""
        self._cuts.add((a, b))
        _ip("-n", self.names[a], "route", "add", "blackhole", f"{self.addrs[b]}/32")
        _ip("-n", self.names[b], "route", "add", "blackhole", f"{self.addrs[a]}/32")

    def heal(self, a: int, b: int) -> None:
        """Remove the blackhole routes of :meth:`cut`."""
        self._cuts.discard((a, b))
        _ip("-n", self.names[a], "route", "del", "blackhole", f"{self.addrs[b]}/32")
        _ip("-n", self.names[b], "route", "del", "blackhole", f"{self.addrs[a]}/32")

    def close(self) -> None:
        """Kill anything still running inside, delete the links, namespaces and bridge."""
        for kind, name in reversed(self._made):
            if kind == "netns":
                pids = _ip("netns", "pids", name, check=False).stdout.split()
                for pid in pids:  # only processes of this test can be in this namespace
                    subprocess.run(["kill", "-CONT", pid], capture_output=True)
                    subprocess.run(["kill", "-KILL", pid], capture_output=True)
        for kind, name in reversed(self._made):
            if kind == "link":
                _ip("link", "del", name, check=False)
            else:
                _ip("netns", "del", name, check=False)
        self._made = []

    def __enter__(self) -> BridgedNamespaces:
        try:
            return self.create()
        except NetnsUnavailable as exc:
            self.close()
            pytest.fail(f"this test needs network namespaces, veth pairs and a bridge "
                        f"(root): {exc}")
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


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
