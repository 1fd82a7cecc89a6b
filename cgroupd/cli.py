"""The ``cgroupd`` command line: the only module that reads argv and the environment.

Commands::

    cgroupd [global options] COMMAND
      join         run one member instance (handler function or webhook), until SIGTERM
      group        create | delete | ls | info
      member       add | drop | ls
      mapping      set | clear
      step-down    ask a member's active instance to hand over to a standby
      status       per partition: member, active instance, lag; --watch, --members
      events       follow the group's advisories
      replay       reprocess from a sequence or a time (dry run unless --execute)
      demo         a self-contained demo with an embedded nats-server

Exit codes: 0 success, 1 operational failure (server unreachable, group missing, any
other cgroupd error), 2 usage error (bad arguments, names, mapping syntax, a handler that
cannot be loaded). Expected errors print one line on stderr; ``--debug`` adds the
traceback. Every option has an environment variable ``CGROUPD_<OPTION>``; the servers also
come from ``NATS_URL``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import Enum, StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup

import cgroupd
from cgroupd import admin, events, logs, replay, views
from cgroupd.config import (
    MAX_PARTITIONS,
    ElasticGroupConfig,
    GroupConfig,
    MemberMapping,
    PartitioningFilter,
    StaticGroupConfig,
    name_problems,
)
from cgroupd.connect import DEFAULT_CONNECT_TIMEOUT, ConnectionOptions, connect
from cgroupd.dispatch import Ordering
from cgroupd.errors import CgroupdError, ConfigError, StreamNotFound
from cgroupd.handlers import (
    DEFAULT_WEBHOOK_TIMEOUT,
    DeadLetterOptions,
    HandlerLoadError,
    HandlerOptions,
    WebhookOptions,
    load_handler,
    parse_statuses,
)
from cgroupd.jetstream import JetStream
from cgroupd.partitions import assignment, key_function
from cgroupd.settings import Exclusivity, MemberSettings
from cgroupd.views import ranges, table

T = TypeVar("T")

PROG = "cgroupd"
USAGE = 2
FAILURE = 1


class CliError(Exception):
    """An expected failure: print ``message`` on one line, exit with ``code``."""

    def __init__(self, message: str, code: int = FAILURE) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def usage(message: str) -> NoReturn:
    raise CliError(message, USAGE)


# -- pure helpers (unit-tested) ---------------------------------------------------------
_ORDINAL = re.compile(r"-(\d+)$")


def member_from_hostname(hostname: str, members: int, prefix: str = "m") -> str:
    """Member name of a StatefulSet pod: ``name-<ordinal>`` → ``<prefix><ordinal % members>``.

    With 3 members, pods 0..2 are m0..m2 and pods 3..5 their standbys. Only the first DNS
    label counts (``web-4.web.ns.svc`` → ordinal 4).
    """
    if members < 1:
        raise ValueError(f"members must be at least 1, not {members}")
    label = hostname.strip().split(".", 1)[0]
    match = _ORDINAL.search(label)
    if not match:
        raise ValueError(f"hostname {hostname!r} does not end in -<ordinal> "
                         "(expected a StatefulSet pod name like worker-0)")
    name = f"{prefix}{int(match.group(1)) % members}"
    problems = name_problems("member", name)
    if problems:
        raise ValueError("; ".join(problems))
    return name


def join_missing(*, stream: str | None, group: str | None, member: str | None,
                 member_from_hostname: int | None, handler: str | None,
                 webhook: str | None) -> str | None:
    """One message naming every missing ``join`` option, in the order people add them
    (what to consume, who this is, what to run), or None when nothing is missing."""
    missing: list[str] = []
    if stream is None:
        missing.append("--stream STREAM")
    if group is None:
        missing.append("--group GROUP")
    if member is None and member_from_hostname is None:
        missing.append("--member MEMBER (or --member-from-hostname MEMBERS to derive it "
                       "from a StatefulSet pod name)")
    if handler is None and webhook is None:
        missing.append("--handler PKG.MODULE:FUNCTION or --webhook URL")
    if not missing:
        return None
    return f"join is missing {len(missing)} option{'s' * (len(missing) > 1)}: " + \
        "; ".join(missing)


def parse_partitions(text: str) -> tuple[int, ...]:
    """``"0,1,4-6"`` → ``(0, 1, 4, 5, 6)``; ValueError on anything else."""
    out: list[int] = []
    seen: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        lo, dash, hi = item.partition("-")
        if not item or not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{item!r} is not a partition number or range like 0-3")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"range {item!r} runs backwards")
        if last >= MAX_PARTITIONS:
            raise ValueError(f"partition {last} is beyond the most a group may have "
                             f"({MAX_PARTITIONS})")
        for p in range(first, last + 1):
            if p in seen:
                raise ValueError(f"partition {p} is listed twice")
            seen.add(p)
            out.append(p)
    return tuple(out)


def parse_mappings(items: Sequence[str]) -> list[MemberMapping]:
    """``["m1=0,1", "m2=2-3"]`` → mappings; ValueError naming the first bad item."""
    if not items:
        raise ValueError("give at least one mapping like m1=0,1")
    out = []
    for item in items:
        member, sep, spec = item.partition("=")
        member = member.strip()
        if not sep or not member or not spec.strip():
            raise ValueError(f"mapping {item!r} must look like MEMBER=0,1 or MEMBER=0-3")
        problems = name_problems("member", member)
        if problems:
            raise ValueError("; ".join(problems))
        try:
            partitions = parse_partitions(spec)
        except ValueError as exc:
            raise ValueError(f"mapping {item!r}: {exc}") from exc
        out.append(MemberMapping(member, partitions))
    return out


def parse_wildcards(text: str) -> tuple[int, ...]:
    """``"1,2"`` → ``(1, 2)``."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or not all(t.isdigit() for t in items):
        raise ValueError(f"--wildcards {text!r} must be wildcard positions like 1 or 1,2")
    return tuple(int(t) for t in items)


def pair_filters(args: Sequence[str]) -> list[tuple[str, str | None]]:
    """Each ``--filter`` with the ``--wildcards`` that follows it, in command-line order."""
    pairs: list[list[str | None]] = []
    it = iter(args)
    for token in it:
        if token == "--":
            break
        for opt in ("--filter", "--wildcards"):
            if token == opt:
                value = next(it, None)
            elif token.startswith(opt + "="):
                value = token[len(opt) + 1:]
            else:
                continue
            if value is None:
                break  # click reports the missing value
            if opt == "--filter":
                pairs.append([value, None])
            elif not pairs:
                raise ValueError(f"--wildcards {value} must follow the --filter it belongs to")
            elif pairs[-1][1] is not None:
                raise ValueError(f"--filter {pairs[-1][0]} has more than one --wildcards")
            else:
                pairs[-1][1] = value
    return [(str(f), w) for f, w in pairs]


# -- error handling ---------------------------------------------------------------------
_state = {"debug": False}


def _error_line(message: str) -> None:
    text = " ".join(str(message).split()) or "error"
    typer.echo(f"{PROG}: error: {text}", err=True)


def exit_code_for(exc: BaseException) -> int:
    """Print what went wrong (one line; traceback with --debug) and pick the exit code."""
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if isinstance(exc, KeyboardInterrupt):
        _error_line("interrupted")
        return 130
    if isinstance(exc, typer.Abort):
        _error_line("aborted")
        return FAILURE
    if isinstance(exc, typer.TyperException):  # click's usage and parameter errors
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
            typer.echo(ctx.get_help())
            return USAGE
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        _error_line(exc.format_message() + hint)
        return int(getattr(exc, "exit_code", USAGE))
    if _state["debug"]:
        traceback.print_exception(exc)
    if isinstance(exc, CliError):
        _error_line(exc.message)
        return exc.code
    if isinstance(exc, (ConfigError, HandlerLoadError)):
        _error_line(str(exc))
        return USAGE
    if isinstance(exc, CgroupdError):
        _error_line(str(exc))
        return FAILURE
    hint = "" if _state["debug"] else " (run with --debug for the traceback)"
    _error_line(f"unexpected {type(exc).__name__}: {exc}{hint}")
    return FAILURE


#: Global flags also accepted after the subcommand (``cgroupd status S G --json``).
_MOVABLE = ("--json", "--debug")


class CgroupdApp(TyperGroup):
    """The top-level group: one place that turns exceptions into one line and a code."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             windows_expand_args: bool = True, **extra: Any) -> Any:
        _state["debug"] = False
        argv = list(sys.argv[1:] if args is None else args)
        if "--" in argv:
            head, tail = argv[:argv.index("--")], argv[argv.index("--"):]
        else:
            head, tail = argv, []
        moved = [a for a in head if a in _MOVABLE]
        argv = moved + [a for a in head if a not in _MOVABLE] + tail
        try:
            rv = super().main(args=argv, prog_name=prog_name or PROG,
                              complete_var=complete_var, standalone_mode=False,
                              windows_expand_args=windows_expand_args, **extra)
            code = rv if isinstance(rv, int) else 0
        except BaseException as exc:  # noqa: BLE001 - the one place errors become codes
            code = exit_code_for(exc)
        if standalone_mode:
            sys.exit(code)
        return code


class PairedFiltersCommand(TyperCommand):
    """Keeps each ``--filter`` paired with the ``--wildcards`` after it (click does not
    record the order across different options)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            ctx.meta["cgroupd.filters"] = pair_filters(args)
        except ValueError as exc:
            usage(str(exc))
        return super().parse_args(ctx, args)


# -- shared state ---------------------------------------------------------------------
@dataclass(frozen=True)
class Globals:
    connection: ConnectionOptions
    json: bool
    debug: bool


def _globals(ctx: typer.Context) -> Globals:
    obj = ctx.find_root().obj
    assert isinstance(obj, Globals)
    return obj


def _check_names(**names: str | Sequence[str]) -> None:
    problems: list[str] = []
    for kind, value in names.items():
        for name in ([value] if isinstance(value, str) else value):
            problems += name_problems(kind, name)
    if problems:
        usage("; ".join(problems))


def _admin(ctx: typer.Context, op: Callable[[JetStream], Awaitable[T]]) -> T:
    """Connect (failing fast), run one admin operation, disconnect."""
    g = _globals(ctx)

    async def go() -> T:
        nc = await connect(g.connection)
        try:
            return await op(JetStream(nc))
        finally:
            await nc.close()

    return asyncio.run(go())


def _emit(ctx: typer.Context, data: Any, human: str | Callable[[], str]) -> None:
    if _globals(ctx).json:
        typer.echo(json.dumps(data, indent=2))
    else:
        typer.echo(human() if callable(human) else human)


# -- app ----------------------------------------------------------------------------
app = typer.Typer(
    cls=CgroupdApp, name=PROG, no_args_is_help=True, add_completion=False,
    pretty_exceptions_enable=False, rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Partitioned consumer groups for NATS JetStream: strict per-key order, "
         "horizontal scale, hot standbys.")
group_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                        help="Create, delete, list and inspect consumer groups.")
member_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                         help="Add, drop and list the members of a group.")
mapping_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                          help="Pin members to partitions explicitly, or go back to "
                               "automatic distribution.")
app.add_typer(group_app, name="group")
app.add_typer(member_app, name="member")
app.add_typer(mapping_app, name="mapping")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"{PROG} {cgroupd.__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    ctx: typer.Context,
    server: Annotated[list[str] | None, typer.Option(
        "--server", "-s", metavar="URL", envvar=["CGROUPD_SERVER", "NATS_URL"],
        help="NATS server URL; repeat or comma-separate for several. "
             "Default: $NATS_URL, then nats://127.0.0.1:4222.")] = None,
    json_output: Annotated[bool, typer.Option(
        "--json", envvar="CGROUPD_JSON", help="Print JSON instead of tables.")] = False,
    debug: Annotated[bool, typer.Option(
        "--debug", envvar="CGROUPD_DEBUG",
        help="Show tracebacks and debug logs.")] = False,
    creds: Annotated[Path | None, typer.Option(
        "--creds", envvar="CGROUPD_CREDS", metavar="FILE", exists=True, dir_okay=False,
        help="NATS credentials (.creds) file.")] = None,
    nkey: Annotated[Path | None, typer.Option(
        "--nkey", envvar="CGROUPD_NKEY", metavar="FILE", exists=True, dir_okay=False,
        help="File holding an nkey seed.")] = None,
    token: Annotated[str | None, typer.Option(
        "--token", envvar="CGROUPD_TOKEN", metavar="TOKEN", help="Authentication token.")] = None,
    user: Annotated[str | None, typer.Option(
        "--user", envvar="CGROUPD_USER", metavar="USER", help="User name.")] = None,
    password: Annotated[str | None, typer.Option(
        "--password", envvar="CGROUPD_PASSWORD", metavar="PASSWORD",
        help="Password of --user.")] = None,
    tls_cert: Annotated[Path | None, typer.Option(
        "--tls-cert", envvar="CGROUPD_TLS_CERT", metavar="FILE", exists=True, dir_okay=False,
        help="Client certificate (mutual TLS).")] = None,
    tls_key: Annotated[Path | None, typer.Option(
        "--tls-key", envvar="CGROUPD_TLS_KEY", metavar="FILE", exists=True, dir_okay=False,
        help="Key of --tls-cert.")] = None,
    tls_ca: Annotated[Path | None, typer.Option(
        "--tls-ca", envvar="CGROUPD_TLS_CA", metavar="FILE", exists=True, dir_okay=False,
        help="CA bundle that signed the server certificate.")] = None,
    connect_timeout: Annotated[float, typer.Option(
        "--connect-timeout", envvar="CGROUPD_CONNECT_TIMEOUT", min=0.1, metavar="SEC",
        help="Give up connecting after this long.")] = DEFAULT_CONNECT_TIMEOUT,
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, expose_value=False,
        help="Print the version and exit.")] = False,
) -> None:
    _state["debug"] = debug
    logs.configure("debug" if debug else "warning")
    connection = ConnectionOptions(
        servers=tuple(server or ()), creds=creds, nkey_seed=nkey, token=token, user=user,
        password=password, tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca,
        connect_timeout=connect_timeout)
    ctx.obj = Globals(connection, json_output, debug)


# -- join ---------------------------------------------------------------------------
class ExclusivityName(StrEnum):
    sync = "sync"
    pinned = "pinned"


class OrderingName(Enum):
    partition = "partition"
    key = "key"
    stream = "stream"
    none = "none"


def _settings(**given: Any) -> MemberSettings:
    chosen = {k: v for k, v in given.items() if v is not None}
    try:
        return MemberSettings(**chosen)
    except ValueError as exc:
        usage(str(exc))


@app.command()
def join(
    ctx: typer.Context,
    # Required, but checked by join_missing() so that one message names all that is missing.
    stream: Annotated[str | None, typer.Option(
        "--stream", envvar="CGROUPD_STREAM", metavar="STREAM",
        help="Stream the group consumes. [required]")] = None,
    group: Annotated[str | None, typer.Option(
        "--group", envvar="CGROUPD_GROUP", metavar="GROUP",
        help="Consumer group name. [required]")] = None,
    member: Annotated[str | None, typer.Option(
        "--member", envvar="CGROUPD_MEMBER", metavar="MEMBER",
        help="Member name of this instance. [required, or --member-from-hostname]")] = None,
    handler: Annotated[str | None, typer.Option(
        "--handler", envvar="CGROUPD_HANDLER", metavar="PKG.MODULE:FUNCTION",
        help="Python function called with each message (sync or async); returning acks, "
             "raising retries.")] = None,
    webhook: Annotated[str | None, typer.Option(
        "--webhook", envvar="CGROUPD_WEBHOOK", metavar="URL",
        help="POST each message here; 2xx acks.")] = None,
    max_deliver: Annotated[int, typer.Option(
        "--max-deliver", envvar="CGROUPD_MAX_DELIVER", min=0, metavar="N",
        help="Give up on a message whose N-th delivery fails (0: retry forever).")] = 0,
    dead_letter_subject: Annotated[str | None, typer.Option(
        "--dead-letter-subject", envvar="CGROUPD_DEAD_LETTER_SUBJECT", metavar="SUBJECT",
        help="Publish given-up messages here (a stream must capture it), then term them. "
             "Without it they are termed and logged.")] = None,
    non_retryable: Annotated[str, typer.Option(
        "--non-retryable", envvar="CGROUPD_NON_RETRYABLE", metavar="STATUSES",
        help="Webhook statuses that give up at once instead of retrying.")] = "400,422",
    webhook_timeout: Annotated[float, typer.Option(
        "--webhook-timeout", envvar="CGROUPD_WEBHOOK_TIMEOUT", metavar="SEC",
        help="Bound on one webhook request.")] = DEFAULT_WEBHOOK_TIMEOUT,
    ordering: Annotated[OrderingName | None, typer.Option(
        "--ordering", envvar="CGROUPD_ORDERING",
        help="partition: in order per partition, partitions concurrently; key: in order "
             "per key, keys concurrently; stream: the whole member in stream order, one "
             "message at a time; none: no order. [default: partition]")] = None,
    key: Annotated[str | None, typer.Option(
        "--key", envvar="CGROUPD_KEY", metavar="SPEC",
        help="What a key is for --ordering key: auto (the partitioning tokens), subject, "
             "partition, tokens:1,3 or header:NAME. [default: auto]")] = None,
    max_in_flight: Annotated[int | None, typer.Option(
        "--max-in-flight", envvar="CGROUPD_MAX_IN_FLIGHT", metavar="N",
        help="Messages unacknowledged at once (running, or held in order: the server "
             "sends ahead). [default: 256]")] = None,
    ack_wait: Annotated[float | None, typer.Option(
        "--ack-wait", envvar="CGROUPD_ACK_WAIT", metavar="SEC",
        help="Redeliver a message not acked within this (kept alive while handling). "
             "[default: 30]")] = None,
    retry_interval: Annotated[float | None, typer.Option(
        "--retry-interval", envvar="CGROUPD_RETRY_INTERVAL", metavar="SEC",
        help="Standby retry and active self-check period. [default: 1]")] = None,
    inactive_threshold: Annotated[float | None, typer.Option(
        "--inactive-threshold", envvar="CGROUPD_INACTIVE_THRESHOLD", metavar="SEC",
        help="Server drops the consumers of an instance nobody replaced after this "
             "(standbys replace a dead one at once). [default: 10]")] = None,
    drain_timeout: Annotated[float | None, typer.Option(
        "--drain-timeout", envvar="CGROUPD_DRAIN_TIMEOUT", metavar="SEC",
        help="On stop or step-down, let running handlers finish this long (at least "
             "--webhook-timeout). [default: 15]")] = None,
    exclusivity: Annotated[ExclusivityName | None, typer.Option(
        "--exclusivity", envvar="CGROUPD_EXCLUSIVITY",
        help="How instances of one member elect the active one. [default: sync]")] = None,
    static: Annotated[bool, typer.Option(
        "--static", envvar="CGROUPD_STATIC",
        help="The group is a static one (default: detected from the group).")] = False,
    metrics_port: Annotated[int, typer.Option(
        "--metrics-port", envvar="CGROUPD_METRICS_PORT", min=0, max=65535, metavar="PORT",
        help="Serve /metrics, /healthz, /readyz here (0: off).")] = 0,
    metrics_host: Annotated[str, typer.Option(
        "--metrics-host", envvar="CGROUPD_METRICS_HOST", metavar="HOST",
        help="Bind address of the metrics server.")] = "0.0.0.0",
    log_level: Annotated[str, typer.Option(
        "--log-level", envvar="CGROUPD_LOG_LEVEL", metavar="LEVEL",
        help="debug, info, warning or error.")] = "info",
    hostname_members: Annotated[int | None, typer.Option(
        "--member-from-hostname", envvar="CGROUPD_MEMBERS", metavar="MEMBERS", min=1,
        help="Derive the member from a StatefulSet hostname name-<ordinal>: "
             "<prefix><ordinal % MEMBERS>.")] = None,
    member_prefix: Annotated[str, typer.Option(
        "--member-prefix", envvar="CGROUPD_MEMBER_PREFIX", metavar="PREFIX",
        help="Prefix of hostname-derived member names.")] = "m",
    instance_id: Annotated[str | None, typer.Option(
        "--instance-id", envvar="CGROUPD_INSTANCE_ID", metavar="ID",
        help="Id of this instance (default: random).")] = None,
    status_interval: Annotated[float, typer.Option(
        "--status-interval", envvar="CGROUPD_STATUS_INTERVAL", min=0.1, max=3600,
        metavar="SEC", help="Refresh the group status (unowned-partitions gauge and "
                            "advisory) and this instance's partition lag this "
                            "often.")] = 10.0,
) -> None:
    """Run one instance of a member: consume its partitions while active, stand by
    otherwise. SIGTERM/SIGINT hands over to a standby and exits 0."""
    from cgroupd.daemon import JoinOptions, drain_problems, run_join

    g = _globals(ctx)
    missing = join_missing(stream=stream, group=group, member=member,
                           member_from_hostname=hostname_members, handler=handler,
                           webhook=webhook)
    if missing:
        usage(missing)
    assert stream is not None and group is not None
    if handler is not None and webhook is not None:
        usage("give one of --handler or --webhook, not both")
    if hostname_members is not None:
        if member is not None:
            usage("give --member or --member-from-hostname, not both")
        try:
            member = member_from_hostname(os.environ.get("HOSTNAME") or socket.gethostname(),
                                          hostname_members, member_prefix)
        except ValueError as exc:
            usage(str(exc))
    assert member is not None
    _check_names(stream=stream, group=group, member=member)
    if instance_id is not None:
        _check_names(instance=instance_id)
    try:
        logs.configure("debug" if g.debug else log_level)
    except ValueError as exc:
        usage(str(exc))
    if key is not None:
        try:
            key_function(key, None)
        except ValueError as exc:
            usage(str(exc))
    settings = _settings(
        ordering=Ordering(ordering.value) if ordering else None, key=key,
        max_in_flight=max_in_flight, ack_wait=ack_wait, retry_interval=retry_interval,
        inactive_threshold=inactive_threshold, drain_timeout=drain_timeout,
        exclusivity=Exclusivity(exclusivity.value) if exclusivity else None)
    try:
        dead_letter = DeadLetterOptions(max_deliver, dead_letter_subject)
        hook = None
        if webhook is not None:
            hook = WebhookOptions(webhook, webhook_timeout, parse_statuses(non_retryable))
    except ValueError as exc:
        usage(str(exc))
    function = None
    if handler is not None:
        # Like other app servers, find handler modules relative to where we run.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        function = load_handler(handler)
    options = JoinOptions(stream, group, member, static=static, instance_id=instance_id,
                          metrics_port=metrics_port, metrics_host=metrics_host,
                          status_interval=status_interval)
    spec = HandlerOptions(function=function, reference=handler, webhook=hook,
                          dead_letter=dead_letter)
    for problem in drain_problems(settings, spec):
        usage(problem)
    try:
        code = asyncio.run(run_join(g.connection, options, settings, spec))
    except ConfigError as exc:  # arguments were checked above: this is the stored group
        raise CliError(str(exc), FAILURE) from exc
    raise typer.Exit(code)


# -- group --------------------------------------------------------------------------
def _kind(config: GroupConfig) -> str:
    return "static" if isinstance(config, StaticGroupConfig) else "elastic"


def _config_json(stream: str, group: str, config: GroupConfig,
                 revision: int | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "stream": stream, "group": group, "type": _kind(config),
        "partitions": config.max_members, "members": list(config.members),
        "mappings": [{"member": m.member, "partitions": list(m.partitions)}
                     for m in config.member_mappings],
        "assignment": {m: list(ps) for m, ps in assignment(config).items()},
    }
    if isinstance(config, ElasticGroupConfig):
        data["filters"] = [{"filter": pf.filter, "wildcards": list(pf.partitioning_wildcards)}
                           for pf in config.partitioning_filters]
        data["max_buffered_msgs"] = config.max_buffered_msgs
        data["max_buffered_bytes"] = config.max_buffered_bytes
        data["consume_stream"] = f"{stream}-{group}"
    else:
        data["filters"] = [{"filter": f, "wildcards": []} for f in config.filters]
        data["consume_stream"] = stream
    if revision is not None:
        data["revision"] = revision
    return data


def _assignment_table(config: GroupConfig) -> str:
    owned = assignment(config)
    if not owned:
        return "no members: no partition is consumed"
    return table(["MEMBER", "PARTITIONS"], [(m, ranges(ps)) for m, ps in sorted(owned.items())])


def _describe(stream: str, group: str, config: GroupConfig,
              revision: int | None = None) -> str:
    if isinstance(config, ElasticGroupConfig):
        filters = ", ".join(
            pf.filter + (f" (wildcards {','.join(map(str, pf.partitioning_wildcards))})"
                         if pf.partitioning_wildcards else " (whole subject)")
            for pf in config.partitioning_filters)
        consume = f"{stream}-{group} (work queue)"
    else:
        filters = ", ".join(config.filters) or "-"
        consume = f"{stream} (subjects start with the partition)"
    if config.member_mappings:
        membership = "mapped: " + "  ".join(f"{m.member}={ranges(m.partitions)}"
                                            for m in config.member_mappings)
    else:
        membership = ", ".join(config.members) or "-"
    rows = [("group", f"{stream}/{group} ({_kind(config)})"),
            ("partitions", str(config.max_members)),
            ("filters", filters),
            ("consumes", consume),
            ("members", membership)]
    if isinstance(config, ElasticGroupConfig) and (config.max_buffered_msgs
                                                   or config.max_buffered_bytes):
        rows.append(("buffer", f"{config.max_buffered_msgs or 'unlimited'} msgs, "
                               f"{config.max_buffered_bytes or 'unlimited'} bytes"))
    if revision is not None:
        rows.append(("revision", str(revision)))
    width = max(len(k) for k, _ in rows)
    head = "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
    return f"{head}\n\n{_assignment_table(config)}"


@group_app.command("create", cls=PairedFiltersCommand, no_args_is_help=True)
def group_create(
    ctx: typer.Context,
    stream: Annotated[str, typer.Argument(metavar="STREAM", help="Origin stream.")],
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Group name.")],
    partitions: Annotated[int, typer.Option(
        "--partitions", min=1, metavar="N",
        help="Number of partitions: the most members that can consume at once.")],
    filter_: Annotated[list[str] | None, typer.Option(
        "--filter", metavar="SUBJECT",
        help="Subject filter to partition (repeatable). Elastic groups need one.")] = None,
    wildcards: Annotated[list[str] | None, typer.Option(
        "--wildcards", metavar="1,2",
        help="Which '*' of the preceding --filter form the key (default: whole "
             "subject).")] = None,
    members: Annotated[list[str] | None, typer.Option(
        "--member", metavar="M", help="Initial member (repeatable).")] = None,
    static: Annotated[bool, typer.Option(
        "--static", help="The stream's subjects already start with the partition "
                         "number: no work-queue stream.")] = False,
    max_buffered_msgs: Annotated[int, typer.Option(
        "--max-buffered-msgs", min=0, metavar="N",
        help="Limit of the group's work-queue stream (0: none).")] = 0,
    max_buffered_bytes: Annotated[int, typer.Option(
        "--max-buffered-bytes", min=0, metavar="N",
        help="Limit of the group's work-queue stream (0: none).")] = 0,
) -> None:
    """Create a group (re-creating an identical one is a no-op)."""
    _check_names(stream=stream, group=group, member=members or [])
    pairs: list[tuple[str, str | None]] = ctx.meta.get("cgroupd.filters", [])
    config: GroupConfig
    if static:
        if wildcards or any(w is not None for _, w in pairs):
            usage("--wildcards applies to elastic groups only")
        if max_buffered_msgs or max_buffered_bytes:
            usage("--max-buffered-* applies to elastic groups only")
        config = StaticGroupConfig(max_members=partitions, filters=tuple(filter_ or ()),
                                   members=tuple(members or ()))
    else:
        if not pairs:
            usage("an elastic group needs at least one --filter SUBJECT")
        try:
            filters = tuple(PartitioningFilter(f, parse_wildcards(w) if w else ())
                            for f, w in pairs)
        except ValueError as exc:
            usage(str(exc))
        config = ElasticGroupConfig(
            max_members=partitions, partitioning_filters=filters,
            members=tuple(members or ()), max_buffered_msgs=max_buffered_msgs,
            max_buffered_bytes=max_buffered_bytes)

    async def op(js: JetStream) -> None:
        if isinstance(config, StaticGroupConfig):
            await admin.create_static_group(js, stream, group, config)
        else:
            await admin.create_elastic_group(js, stream, group, config)

    _admin(ctx, op)
    _emit(ctx, _config_json(stream, group, config),
          lambda: f"created {_kind(config)} group {stream}/{group} with {partitions} "
                  f"partitions\n\n{_assignment_table(config)}")


@group_app.command("delete", no_args_is_help=True)
def group_delete(
    ctx: typer.Context,
    stream: Annotated[str, typer.Argument(metavar="STREAM", help="Origin stream.")],
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Group name.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
) -> None:
    """Delete a group: its members stop, its work-queue stream is removed."""
    _check_names(stream=stream, group=group)
    if not yes and not typer.confirm(
            f"Delete consumer group {stream}/{group} and its buffered messages?"):
        raise CliError("not deleted")
    _admin(ctx, lambda js: admin.delete_group(js, stream, group))
    _emit(ctx, {"stream": stream, "group": group, "deleted": True},
          f"deleted group {stream}/{group}")


@group_app.command("ls", no_args_is_help=True)
def group_ls(
    ctx: typer.Context,
    stream: Annotated[str, typer.Argument(metavar="STREAM", help="Origin stream.")],
) -> None:
    """List the groups of a stream."""
    _check_names(stream=stream)

    async def op(js: JetStream) -> list[dict[str, Any]]:
        if await js.stream_info(stream) is None:
            raise StreamNotFound(f"stream {stream!r} does not exist")
        out = []
        for name, _kind_name in await admin.list_groups(js, stream):
            stored = await admin.get_group(js, stream, name)
            out.append(_config_json(stream, name, stored.config, stored.revision))
        return out

    groups = _admin(ctx, op)

    def human() -> str:
        if not groups:
            return f"no consumer groups on stream {stream}"
        return table(["GROUP", "TYPE", "PARTITIONS", "MEMBERS"],
                     [(g["group"], g["type"], g["partitions"],
                       ", ".join(g["assignment"]) or "-") for g in groups])

    _emit(ctx, groups, human)


@group_app.command("info", no_args_is_help=True)
def group_info(
    ctx: typer.Context,
    stream: Annotated[str, typer.Argument(metavar="STREAM", help="Origin stream.")],
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Group name.")],
) -> None:
    """Show a group's configuration and who owns which partitions."""
    _check_names(stream=stream, group=group)
    stored = _admin(ctx, lambda js: admin.get_group(js, stream, group))
    _emit(ctx, _config_json(stream, group, stored.config, stored.revision),
          lambda: _describe(stream, group, stored.config, stored.revision))


# -- member -------------------------------------------------------------------------
def _membership_out(ctx: typer.Context, stream: str, group: str, config: GroupConfig,
                    verb: str) -> None:
    _emit(ctx, _config_json(stream, group, config),
          lambda: f"{verb}; members of {stream}/{group}: "
                  f"{', '.join(config.member_names) or '-'}\n\n{_assignment_table(config)}")


@member_app.command("add", no_args_is_help=True)
def member_add(
    ctx: typer.Context,
    stream: Annotated[str, typer.Argument(metavar="STREAM", help="Origin stream.")],
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Group name.")],
    members: Annotated[list[str], typer.Argument(metavar="MEMBER...", help="Members to add.")],
) -> None:
    """Add members (partitions are redistributed)."""
    _check_names(stream=stream, group=group, member=members)
    config = _admin(ctx, lambda js: admin.add_members(js, stream, group, members))
    _membership_out(ctx, stream, group, config, f"added {', '.join(members)}")


@member_app.command("drop", no_args_is_help=True)
def member_drop(
    ctx: typer.Context,
    stream: Annotated[str, typer.Argument(metavar="STREAM", help="Origin stream.")],
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Group name.")],
    members: Annotated[list[str], typer.Argument(metavar="MEMBER...",
                                                 help="Members to drop.")],
) -> None:
    """Drop members (their partitions move to the others)."""
    _check_names(stream=stream, group=group, member=members)
    config = _admin(ctx, lambda js: admin.drop_members(js, stream, group, members))
    _membership_out(ctx, stream, group, config, f"dropped {', '.join(members)}")


@member_app.command("ls", no_args_is_help=True)
def member_ls(
    ctx: typer.Context,
    stream: Annotated[str, typer.Argument(metavar="STREAM", help="Origin stream.")],
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Group name.")],
) -> None:
    """Members (like Kafka's --describe --members): partitions, lag, active instance, and
    every running instance with its state, host, pid, since when and partitions."""
    _check_names(stream=stream, group=group)

    async def op(js: JetStream) -> tuple[admin.GroupStatus, list[dict[str, Any]]]:
        return await _status_and_instances(js, stream, group, events.DISCOVERY_WAIT)

    st, instances = _admin(ctx, op)
    rows = views.members_data(st, instances)
    _emit(ctx, rows, lambda: views.members_text(stream, group, rows))


# -- mapping ------------------------------------------------------------------------
@mapping_app.command("set", no_args_is_help=True)
def mapping_set(
    ctx: typer.Context,
    stream: Annotated[str, typer.Argument(metavar="STREAM", help="Origin stream.")],
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Group name.")],
    mappings: Annotated[list[str], typer.Argument(
        metavar="MEMBER=PARTITIONS...", help="e.g. m1=0,1 m2=2-3")],
) -> None:
    """Replace the membership with explicit member=partitions mappings."""
    _check_names(stream=stream, group=group)
    try:
        chosen = parse_mappings(mappings)
    except ValueError as exc:
        usage(str(exc))
    config = _admin(ctx, lambda js: admin.set_mappings(js, stream, group, chosen))
    _membership_out(ctx, stream, group, config, "mappings set")


@mapping_app.command("clear", no_args_is_help=True)
def mapping_clear(
    ctx: typer.Context,
    stream: Annotated[str, typer.Argument(metavar="STREAM", help="Origin stream.")],
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Group name.")],
) -> None:
    """Drop the mappings; their members are distributed automatically."""
    _check_names(stream=stream, group=group)
    config = _admin(ctx, lambda js: admin.clear_mappings(js, stream, group))
    _membership_out(ctx, stream, group, config, "mappings cleared")


# -- step-down and status -------------------------------------------------------------
@app.command("step-down", no_args_is_help=True)
def step_down(
    ctx: typer.Context,
    stream: Annotated[str, typer.Argument(metavar="STREAM", help="Origin stream.")],
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Group name.")],
    member: Annotated[str, typer.Argument(
        metavar="MEMBER", help="Member whose active instance steps down.")],
) -> None:
    """Ask a member's active instance to hand over to a standby (exit 1 if none)."""
    _check_names(stream=stream, group=group, member=member)
    done = _admin(ctx, lambda js: admin.step_down(js, stream, group, member))
    if not done:
        raise CliError(f"member {member} of {stream}/{group} has no active instance")
    _emit(ctx, {"stream": stream, "group": group, "member": member, "stepped_down": True},
          f"asked the active instance of {member} to step down")


@app.command(no_args_is_help=True)
def status(
    ctx: typer.Context,
    stream: Annotated[str, typer.Argument(metavar="STREAM", help="Origin stream.")],
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Group name.")],
    members: Annotated[bool, typer.Option(
        "--members", help="Per member and instance instead (as `member ls`).")] = False,
    watch: Annotated[bool, typer.Option(
        "--watch", "-w", help="Refresh until Ctrl-C: lag bars, trends, rates.")] = False,
    interval: Annotated[float, typer.Option(
        "--interval", min=0.2, max=3600, metavar="SEC",
        help="Seconds between refreshes of --watch.")] = 2.0,
) -> None:
    """Per partition: member, active instance and its host, lag in messages and time,
    in flight."""
    _check_names(stream=stream, group=group)
    if members:
        member_ls(ctx, stream, group)
        return
    if watch:
        raise typer.Exit(_watch_status(ctx, stream, group, interval))

    async def op(js: JetStream) -> tuple[admin.GroupStatus, list[dict[str, Any]]]:
        return await _status_and_instances(js, stream, group)

    st, instances = _admin(ctx, op)
    data = views.status_data(st, instances)
    _emit(ctx, data, lambda: views.status_text(data, st))


#: Seconds ``status`` listens for instances answering discovery (hosts, standbys).
STATUS_DISCOVERY_WAIT = 0.25


async def _status_and_instances(js: JetStream, stream: str, group: str,
                                wait: float = STATUS_DISCOVERY_WAIT
                                ) -> tuple[admin.GroupStatus, list[dict[str, Any]]]:
    st = await admin.group_status(js, stream, group, in_flight=True)
    found = await events.discover(js.nc, stream, group, wait) if wait > 0 else []
    return st, found


def _stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT/SIGTERM: Ctrl-C ends a following command normally (exit 0).
    Outside the main thread (tests) the default handling stays."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return stop


def _watch_status(ctx: typer.Context, stream: str, group: str, interval: float) -> int:
    """``status --watch``: a full-screen view redrawn every ``interval`` on a terminal
    (alternate screen, like ``top``); one frame after another, or one JSON object per
    line with ``--json``, when not on a terminal. Once the first view is shown, a failed
    refresh (server restarting, group deleted and re-created) is shown and retried, never
    the end of the view; logs stay off the live screen unless --debug."""
    g = _globals(ctx)
    out = sys.stdout
    live = out.isatty() and not g.json
    if live and not g.debug:
        logs.configure("critical")  # the screen itself says what goes wrong

    async def go() -> int:
        nc = await connect(g.connection)
        stop = _stop_on_signals()
        previous: dict[str, Any] | None = None
        shown: str | None = None
        last = 0.0
        last_clock = ""
        if live:
            out.write("\x1b[?1049h\x1b[?25l")  # alternate screen, hide the cursor
        try:
            js = JetStream(nc)
            while not stop.is_set():
                started = time.monotonic()
                clock = time.strftime("%H:%M:%S")
                size = shutil.get_terminal_size((100, 40))
                try:
                    data = await _watch_read(js, stream, group)
                except Exception as exc:  # shown, then retried
                    if previous is None:
                        raise  # nothing shown yet: a typo or no server, fail at once
                    problem = _problem(exc)
                    if g.json:
                        frame = json.dumps({"time": events.iso(time.time()),
                                            "error": problem})
                    else:
                        frame = views.watch_problem_frame(
                            stream, group, problem, clock, last_clock,
                            shown if live else None, size.columns, size.lines)
                else:
                    now = time.monotonic()
                    if g.json:
                        data["time"] = events.iso(time.time())
                        frame = json.dumps(data)
                    else:
                        frame = shown = views.watch_frame(
                            data, previous, now - last if last else 0.0, size.columns,
                            size.lines, clock)
                    previous, last, last_clock = data, now, clock
                if live:
                    out.write("\x1b[H\x1b[2J" + frame + "\n")
                else:
                    out.write(frame + ("\n" if g.json else "\n\n"))
                out.flush()
                # A steady cadence: the refresh itself (discovery wait included) counts.
                pause = max(0.05, interval - (time.monotonic() - started))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), pause)
        finally:
            if live:
                out.write("\x1b[?25h\x1b[?1049l")
                out.flush()
            await nc.close()
        return 0

    return asyncio.run(go())


async def _watch_read(js: JetStream, stream: str, group: str) -> dict[str, Any]:
    """One refresh of ``status --watch``: the status view plus the work stream's last
    sequence (for the rates)."""
    st, instances = await _status_and_instances(js, stream, group)
    data = views.status_data(st, instances)
    info = await js.stream_info(st.group.consume_stream)
    data["appended"] = int(info.state.last_seq) if info is not None else 0
    return data


def _problem(exc: BaseException) -> str:
    """A one-line description of a failed refresh."""
    if isinstance(exc, CgroupdError):
        return str(exc)
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# -- events ---------------------------------------------------------------------------
@app.command("events", no_args_is_help=True)
def events_(
    ctx: typer.Context,
    stream: Annotated[str, typer.Argument(metavar="STREAM", help="Origin stream.")],
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Group name.")],
    count: Annotated[int, typer.Option(
        "--count", "-n", min=0, metavar="N", help="Exit after N events (0: never).")] = 0,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0, metavar="SEC",
        help="Exit (code 1) if fewer than --count events came within this (0: wait "
             "forever).")] = 0,
) -> None:
    """Follow the group's advisories (became active, stepped down, partitions moved,
    partitions nobody consumes), like `nats events`; --json prints one object a line."""
    _check_names(stream=stream, group=group)
    g = _globals(ctx)

    async def go() -> int:
        nc = await connect(g.connection)
        seen = 0
        stop = _stop_on_signals()

        def ready() -> None:
            # On stderr in both forms: once it shows, no later event is missed.
            typer.echo(f"following events of {stream}/{group} "
                       f"({events.events_filter(stream, group)}); Ctrl-C to stop", err=True)

        async def consume() -> None:
            nonlocal seen
            async for event in events.follow(nc, stream, group, ready):
                typer.echo(json.dumps(event) if g.json else views.event_line(event))
                seen += 1
                if count and seen >= count:
                    return

        try:
            await admin.get_group(JetStream(nc), stream, group)  # a typo fails at once
            following = asyncio.ensure_future(consume())
            stopping = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait({following, stopping}, timeout=timeout or None,
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in (following, stopping):
                task.cancel()
            # Let them end before the connection closes (the follower unsubscribes).
            await asyncio.gather(following, stopping, return_exceptions=True)
            if following in done:
                following.result()
            elif count and stopping not in done:
                _error_line(f"{seen} of {count} events within {timeout:g}s")
                return FAILURE
            return 0
        finally:
            await nc.close()

    raise typer.Exit(asyncio.run(go()))


# -- replay ---------------------------------------------------------------------------
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|d|h|m|s)")
_ISO_DURATION = re.compile(r"P(?:(\d+(?:\.\d+)?)D)?(?:T(?:(\d+(?:\.\d+)?)H)?"
                           r"(?:(\d+(?:\.\d+)?)M)?(?:(\d+(?:\.\d+)?)S)?)?")


def parse_duration(text: str) -> float:
    """``90s``, ``1h30m``, ``2d``, ``500ms`` or ISO 8601 ``PT1H30M`` / ``P1DT2H`` (Kafka's
    ``--by-duration`` form) → seconds; ValueError on anything else or on zero."""
    t = text.strip()
    seconds = 0.0
    iso = _ISO_DURATION.fullmatch(t.upper())
    if iso and t.upper() not in ("P", "PT") and any(iso.groups()):
        d, h, m, s = (float(x) if x else 0.0 for x in iso.groups())
        seconds = d * 86400 + h * 3600 + m * 60 + s
    else:
        pos = 0
        units = {"d": 86400, "h": 3600, "m": 60, "s": 1, "ms": 0.001}
        for match in _DURATION.finditer(t):
            if match.start() != pos:
                break
            seconds += float(match.group(1)) * units[match.group(2)]
            pos = match.end()
        if pos != len(t) or not t:
            raise ValueError(f"{text!r} is not a duration like 90s, 1h30m, 2d or PT1H30M")
    if not seconds > 0 or seconds > 10 * 365 * 86400:
        raise ValueError(f"duration {text!r} must be positive (and under ten years)")
    return seconds


def parse_time(text: str) -> float:
    """An ISO 8601 time (``2026-05-01T10:00:00Z``, with an offset, or local time when it
    has none) → Unix seconds; ValueError otherwise."""
    t = text.strip()
    try:
        when = datetime.fromisoformat(t[:-1] + "+00:00" if t.endswith(("Z", "z")) else t)
    except ValueError:
        raise ValueError(f"{text!r} is not a time like 2026-05-01T10:00:00Z") from None
    if when.tzinfo is None:
        when = when.astimezone()  # local time, as Kafka's --to-datetime
    return when.timestamp()


@app.command("replay", no_args_is_help=True)
def replay_(
    ctx: typer.Context,
    stream: Annotated[str, typer.Argument(metavar="STREAM", help="Origin stream.")],
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Group name.")],
    to_earliest: Annotated[bool, typer.Option(
        "--to-earliest", help="From the oldest message still stored.")] = False,
    to_sequence: Annotated[int | None, typer.Option(
        "--to-sequence", min=1, metavar="SEQ",
        help="From this stream sequence (of the origin stream).")] = None,
    to_time: Annotated[str | None, typer.Option(
        "--to-time", metavar="TIME",
        help="From the first message stored at or after this ISO 8601 time "
             "(2026-05-01T10:00:00Z; local time without an offset).")] = None,
    by_duration: Annotated[str | None, typer.Option(
        "--by-duration", metavar="DURATION",
        help="From this long ago: 90s, 1h30m, 2d or PT1H30M.")] = None,
    members: Annotated[list[str] | None, typer.Option(
        "--member", metavar="M", help="Static groups: only this member (repeatable).")] = None,
    execute: Annotated[bool, typer.Option(
        "--execute", help="Do it (default: a dry run that only shows the plan).")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Only show the plan (the default).")] = False,
) -> None:
    """Process messages again from a point ("reset offsets"): a static group's member
    consumers move there, an elastic group's work-queue stream is sourced again from
    there. Shows per partition what would be processed again; changes nothing without
    --execute, and refuses while the group's instances run."""
    _check_names(stream=stream, group=group, member=members or [])
    if execute and dry_run:
        usage("give --execute or --dry-run, not both")
    try:
        when = (parse_time(to_time) if to_time is not None else
                time.time() - parse_duration(by_duration) if by_duration is not None
                else None)
        target = replay.Target(earliest=to_earliest, sequence=to_sequence, time=when)
    except ValueError as exc:
        usage(str(exc) if "exactly one" not in str(exc) else
              "give exactly one of --to-earliest, --to-sequence, --to-time or --by-duration")

    async def op(js: JetStream) -> replay.Plan:
        if execute:
            return await replay.execute(js, stream, group, target, members or None)
        return await replay.plan(js, stream, group, target, members or None)

    done = _admin(ctx, op)
    data = done.to_json()
    _emit(ctx, data, lambda: views.replay_text(data))


# -- demo -----------------------------------------------------------------------------
@app.command()
def demo(
    server: Annotated[str | None, typer.Option(
        "--server", metavar="URL",
        help="Use this server instead of an embedded nats-server.")] = None,
    duration: Annotated[float, typer.Option(
        "--duration", min=1, metavar="SEC", help="Run this long (Ctrl-C ends early).")] = 20,
    members: Annotated[int, typer.Option(
        "--members", min=1, max=20, metavar="N", help="Members, each with a standby.")] = 3,
    partitions: Annotated[int, typer.Option(
        "--partitions", min=1, max=64, metavar="N", help="Partitions.")] = 6,
    rate: Annotated[float, typer.Option(
        "--rate", min=1, max=5000, metavar="N", help="Messages published per second.")] = 50,
) -> None:
    """Watch a group at work: embedded server, members with standbys, keyed traffic, and a
    killed active instance failing over."""
    from cgroupd.demo import DemoOptions, run_demo

    if partitions < members:
        usage(f"--partitions ({partitions}) must be at least --members ({members})")
    options = DemoOptions(server=server, duration=duration, members=members,
                          partitions=partitions, rate=rate, interactive=sys.stdout.isatty())
    raise typer.Exit(asyncio.run(run_demo(options)))


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point."""
    typer.main.get_command(app).main(args=argv, prog_name=PROG)


if __name__ == "__main__":  # pragma: no cover
    main()
