"""``cgroupd join``: run one instance of a member until SIGTERM.

The help's defaults come from :class:`~cgroupd.core.settings.MemberSettings` (and the handler
module's constants), never restated: changing a default there changes ``join --help``.
"""

from __future__ import annotations

import asyncio
import os
import socket
from enum import Enum, StrEnum
from typing import Annotated, Any

import typer

from cgroupd.cli.context import check_names, globals_of
from cgroupd.cli.errors import CliError, UsageError, bad_arguments
from cgroupd.cli.parsers import join_missing, member_from_hostname
from cgroupd.core import logs
from cgroupd.core.errors import ConfigError
from cgroupd.core.ordering import Ordering
from cgroupd.core.partitions import key_function
from cgroupd.core.settings import Exclusivity, MemberSettings
from cgroupd.join.handlers import (
    DEFAULT_NON_RETRYABLE,
    DEFAULT_WEBHOOK_TIMEOUT,
    AuthHeaders,
    DeadLetterOptions,
    HandlerOptions,
    WebhookOptions,
    load_handler,
    parse_statuses,
)
from cgroupd.join.options import DEFAULT_METRICS_HOST, HTTP_MAX_CONNECTIONS, HTTP_READ_TIMEOUT
from cgroupd.join.run import EXEC_ENV, JoinSpec, add_working_directory, exec_join


class ExclusivityName(StrEnum):
    sync = "sync"
    pinned = "pinned"


class OrderingName(Enum):
    partition = "partition"
    key = "key"
    stream = "stream"
    none = "none"


#: Whether ``join`` replaces the process with a lean one once its arguments are checked
#: (:mod:`cgroupd.join.run`): only when the CLI is the process (``main()`` with the
#: process's own argv), never when it runs inside a caller (tests, bench.variant).
LEAN = {"exec": False}

#: What a member instance does when ``join`` is given no setting.
DEFAULTS = MemberSettings()


def _default(name: str) -> str:
    """The help's "[default: ...]" note of a MemberSettings field (formatted as typer does)."""
    value = getattr(DEFAULTS, name)
    if isinstance(value, Enum):
        value = value.value
    elif isinstance(value, float):
        value = f"{value:g}"
    return f"[default: {value}]"


def _setting(flag: str, envvar: str, help: str, field: str, metavar: str | None = "SEC"
             ) -> Any:
    """The option of a MemberSettings field: not given (None), the field's default applies,
    and the help says which."""
    return typer.Option(flag, envvar=envvar, metavar=metavar, help=f"{help} {_default(field)}")


def _settings(**given: Any) -> MemberSettings:
    """MemberSettings from the options given (None: not given, the default applies)."""
    with bad_arguments():
        return MemberSettings(**{k: v for k, v in given.items() if v is not None})


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
        help="Webhook statuses that give up at once instead of retrying.")
    ] = ",".join(map(str, sorted(DEFAULT_NON_RETRYABLE))),
    webhook_timeout: Annotated[float, typer.Option(
        "--webhook-timeout", envvar="CGROUPD_WEBHOOK_TIMEOUT", metavar="SEC",
        help="Bound on one webhook request.")] = DEFAULT_WEBHOOK_TIMEOUT,
    webhook_events: Annotated[bool, typer.Option(
        "--webhook-events", envvar="CGROUPD_WEBHOOK_EVENTS",
        help="Also POST partition listener events to the webhook (header Cgroupd-Event: "
             "partitions-assigned|revoked|lost, a JSON body).")] = False,
    webhook_header_file: Annotated[str | None, typer.Option(
        "--webhook-header-file", envvar="CGROUPD_WEBHOOK_HEADER_FILE", metavar="PATH",
        help="Send the 'Name: value' lines of this file (e.g. 'Authorization: Bearer ...') "
             "as headers of every webhook request; re-read when it changes. Credentials "
             "belong here, not in the URL.")] = None,
    webhook_token_file: Annotated[str | None, typer.Option(
        "--webhook-token-file", envvar="CGROUPD_WEBHOOK_TOKEN_FILE", metavar="PATH",
        help="Send the token in this file as 'Authorization: Bearer <token>'; re-read when "
             "it changes.")] = None,
    webhook_ca: Annotated[str | None, typer.Option(
        "--webhook-ca", envvar="CGROUPD_WEBHOOK_CA", metavar="PATH",
        help="CA bundle (PEM) that verifies an https webhook (default: the system's CAs).")
    ] = None,
    webhook_cert: Annotated[str | None, typer.Option(
        "--webhook-cert", envvar="CGROUPD_WEBHOOK_CERT", metavar="PATH",
        help="Client certificate (PEM) for a webhook that wants mutual TLS.")] = None,
    webhook_key: Annotated[str | None, typer.Option(
        "--webhook-key", envvar="CGROUPD_WEBHOOK_KEY", metavar="PATH",
        help="Key of --webhook-cert (when not in the same file).")] = None,
    dead_letter_error_body: Annotated[bool, typer.Option(
        "--dead-letter-error-body", envvar="CGROUPD_DEAD_LETTER_ERROR_BODY",
        help="Keep the start of the webhook's error answer in the dead letter's "
             "Cgroupd-Error header (default: only the status; the answer is logged).")
    ] = False,
    ordering: Annotated[OrderingName | None, _setting(
        "--ordering", "CGROUPD_ORDERING", "partition: in order per partition, partitions "
        "concurrently; key: in order per key, keys concurrently; stream: the whole member "
        "in stream order, one message at a time; none: no order.", "ordering", None)
    ] = None,
    key: Annotated[str | None, _setting(
        "--key", "CGROUPD_KEY", "What a key is for --ordering key: auto (the partitioning "
        "tokens), subject, partition, tokens:1,3 or header:NAME.", "key", "SPEC")] = None,
    max_in_flight: Annotated[int | None, _setting(
        "--max-in-flight", "CGROUPD_MAX_IN_FLIGHT", "Messages unacknowledged at once "
        "(running, or held in order: the server sends ahead).", "max_in_flight", "N")] = None,
    ack_wait: Annotated[float | None, _setting(
        "--ack-wait", "CGROUPD_ACK_WAIT", "Redeliver a message not acked within this (kept "
        "alive while handling).", "ack_wait")] = None,
    retry_interval: Annotated[float | None, _setting(
        "--retry-interval", "CGROUPD_RETRY_INTERVAL",
        "Standby retry and active self-check period.", "retry_interval")] = None,
    inactive_threshold: Annotated[float | None, _setting(
        "--inactive-threshold", "CGROUPD_INACTIVE_THRESHOLD", "Server drops the consumers "
        "of an instance nobody replaced after this (standbys replace a dead one at once).",
        "inactive_threshold")] = None,
    drain_timeout: Annotated[float | None, _setting(
        "--drain-timeout", "CGROUPD_DRAIN_TIMEOUT", "On stop or step-down, let running "
        "handlers finish this long (at least --webhook-timeout).", "drain_timeout")] = None,
    exclusivity: Annotated[ExclusivityName | None, _setting(
        "--exclusivity", "CGROUPD_EXCLUSIVITY",
        "How instances of one member elect the active one.", "exclusivity", None)] = None,
    static: Annotated[bool, typer.Option(
        "--static", envvar="CGROUPD_STATIC",
        help="The group is a static one (default: detected from the group).")] = False,
    metrics_port: Annotated[int, typer.Option(
        "--metrics-port", envvar="CGROUPD_METRICS_PORT", min=0, max=65535, metavar="PORT",
        help="Serve /metrics, /healthz, /readyz here (0: off).")] = 0,
    metrics_host: Annotated[str, typer.Option(
        "--metrics-host", envvar="CGROUPD_METRICS_HOST", metavar="HOST",
        help="Bind address of the metrics server (every interface by default, for "
             "Kubernetes probes and Prometheus; 127.0.0.1 keeps it local).")
    ] = DEFAULT_METRICS_HOST,
    http_read_timeout: Annotated[float, typer.Option(
        "--http-read-timeout", envvar="CGROUPD_HTTP_READ_TIMEOUT", metavar="SEC",
        help="Close an HTTP connection that has not sent its request within this.")
    ] = HTTP_READ_TIMEOUT,
    http_max_connections: Annotated[int, typer.Option(
        "--http-max-connections", envvar="CGROUPD_HTTP_MAX_CONNECTIONS", metavar="N",
        help="HTTP connections held at once (at most an eighth of the open-file limit); "
             "beyond it the oldest unfinished one is closed.")] = HTTP_MAX_CONNECTIONS,
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
) -> int:
    """Run one instance of a member: consume its partitions while active, stand by
    otherwise. SIGTERM/SIGINT hands over to a standby and exits 0."""
    from cgroupd.join.daemon import JoinOptions, drain_problems, run_join

    g = globals_of(ctx)
    missing = join_missing(stream=stream, group=group, member=member,
                           member_from_hostname=hostname_members, handler=handler,
                           webhook=webhook)
    if missing:
        raise UsageError(missing)
    assert stream is not None and group is not None
    if handler is not None and webhook is not None:
        raise UsageError("give one of --handler or --webhook, not both")
    if webhook_events and webhook is None:
        raise UsageError("--webhook-events needs --webhook (a --handler module defines "
                         "on_partitions_assigned/_revoked/_lost instead)")
    if hostname_members is not None:
        if member is not None:
            raise UsageError("give --member or --member-from-hostname, not both")
        with bad_arguments():
            member = member_from_hostname(os.environ.get("HOSTNAME") or socket.gethostname(),
                                          hostname_members, member_prefix)
    assert member is not None
    check_names(stream=stream, group=group, member=member)
    if instance_id is not None:
        check_names(instance=instance_id)
    with bad_arguments():
        logs.configure("debug" if g.debug else log_level)
        if key is not None:
            key_function(key, None)
    settings = _settings(
        ordering=Ordering(ordering.value) if ordering else None, key=key,
        max_in_flight=max_in_flight, ack_wait=ack_wait, retry_interval=retry_interval,
        inactive_threshold=inactive_threshold, drain_timeout=drain_timeout,
        exclusivity=Exclusivity(exclusivity.value) if exclusivity else None)
    with bad_arguments():
        dead_letter = DeadLetterOptions(max_deliver, dead_letter_subject,
                                        error_body=dead_letter_error_body)
        hook = None
        if webhook is not None:
            hook = WebhookOptions(webhook, webhook_timeout, parse_statuses(non_retryable),
                                  events=webhook_events, header_file=webhook_header_file,
                                  token_file=webhook_token_file, ca_file=webhook_ca,
                                  cert_file=webhook_cert, key_file=webhook_key)
            AuthHeaders(hook)  # the files are readable and well formed (names no value)
            hook.ssl_context()
        elif any((webhook_header_file, webhook_token_file, webhook_ca, webhook_cert,
                  webhook_key)):
            raise UsageError("the --webhook-* options need --webhook")
    function = None
    if handler is not None:
        # Like other app servers, find handler modules where we run (last on the path:
        # a module planted there never shadows the standard library).
        add_working_directory()
        function = load_handler(handler)
    options = JoinOptions(stream, group, member, static=static, instance_id=instance_id,
                          metrics_port=metrics_port, metrics_host=metrics_host,
                          status_interval=status_interval,
                          http_read_timeout=http_read_timeout,
                          http_max_connections=http_max_connections)
    spec = HandlerOptions(function=function, reference=handler, webhook=hook,
                          dead_letter=dead_letter)
    problems = drain_problems(settings, spec)
    if problems:
        raise UsageError(problems[0])
    if LEAN["exec"] and os.environ.get(EXEC_ENV, "1") != "0":
        exec_join(JoinSpec(g.connection, options, settings, handler, hook, dead_letter,
                           "debug" if g.debug else log_level, g.debug))
    try:
        return asyncio.run(run_join(g.connection, options, settings, spec))
    except ConfigError as exc:  # arguments were checked above: this is the stored group
        raise CliError(str(exc)) from exc
