"""The ``cgroupd`` typer app: its commands, the global options, and the one place that
turns what a command raised into one line on stderr and an exit code.

Commands only raise (:mod:`cgroupd.cli.errors`, the cgroupd error tree) or return an
exit code; :func:`exit_code_for` decides what the user sees.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

import cgroupd
from cgroupd.cli import console, demo, groups, join, members, observe, replay
from cgroupd.cli.context import Globals
from cgroupd.cli.errors import CliError, UsageError
from cgroupd.cli.natscontext import with_context
from cgroupd.core import logs
from cgroupd.core.errors import BadRecord, CgroupdError, ConfigError
from cgroupd.core.exits import FAILURE, INTERRUPTED, PROG, USAGE, error_line
from cgroupd.join.handlers import HandlerLoadError
from cgroupd.nats.connect import DEFAULT_CONNECT_TIMEOUT

_state = {"debug": False}


def _error_line(message: str) -> None:
    typer.echo(error_line(message), err=True)


def exit_code_for(exc: BaseException) -> int:
    """Print what went wrong (one line; traceback with --debug) and pick the exit code."""
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if isinstance(exc, KeyboardInterrupt):
        _error_line("interrupted")
        return INTERRUPTED
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
    if isinstance(exc, (UsageError, ConfigError, HandlerLoadError)) and not isinstance(
            exc, BadRecord):  # a stored record is not what the user typed
        _error_line(str(exc))
        return USAGE
    if isinstance(exc, (CliError, CgroupdError)):
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

# Every command, in the order `cgroupd --help` lists them.
app.command("join")(join.join)
app.command("step-down", no_args_is_help=True)(members.step_down)
app.command("status", no_args_is_help=True)(observe.status)
app.command("events", no_args_is_help=True)(observe.events_)
app.command("replay", no_args_is_help=True)(replay.replay_)
app.command("console")(console.console)
app.command("demo")(demo.demo)
app.add_typer(group_app, name="group")
group_app.command("create", cls=groups.PairedFiltersCommand, no_args_is_help=True)(
    groups.create)
group_app.command("delete", no_args_is_help=True)(groups.delete)
group_app.command("ls", no_args_is_help=True)(groups.ls)
group_app.command("info", no_args_is_help=True)(groups.info)
app.add_typer(member_app, name="member")
member_app.command("add", no_args_is_help=True)(members.add)
member_app.command("drop", no_args_is_help=True)(members.drop)
member_app.command("ls", no_args_is_help=True)(members.ls)
app.add_typer(mapping_app, name="mapping")
mapping_app.command("set", no_args_is_help=True)(members.mapping_set)
mapping_app.command("clear", no_args_is_help=True)(members.mapping_clear)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"{PROG} {cgroupd.__version__}")
        raise typer.Exit(0)


def _file(flag: str, envvar: str, help: str) -> Any:
    """An option naming a file that must exist (credentials, keys, certificates)."""
    return typer.Option(flag, envvar=envvar, metavar="FILE", exists=True, dir_okay=False,
                        help=help)


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
    creds: Annotated[Path | None, _file(
        "--creds", "CGROUPD_CREDS", "NATS credentials (.creds) file.")] = None,
    nkey: Annotated[Path | None, _file(
        "--nkey", "CGROUPD_NKEY", "File holding an nkey seed.")] = None,
    token: Annotated[str | None, typer.Option(
        "--token", envvar="CGROUPD_TOKEN", metavar="TOKEN", help="Authentication token.")] = None,
    user: Annotated[str | None, typer.Option(
        "--user", envvar="CGROUPD_USER", metavar="USER", help="User name.")] = None,
    password: Annotated[str | None, typer.Option(
        "--password", envvar="CGROUPD_PASSWORD", metavar="PASSWORD",
        help="Password of --user.")] = None,
    tls_cert: Annotated[Path | None, _file(
        "--tls-cert", "CGROUPD_TLS_CERT", "Client certificate (mutual TLS).")] = None,
    tls_key: Annotated[Path | None, _file(
        "--tls-key", "CGROUPD_TLS_KEY", "Key of --tls-cert.")] = None,
    tls_ca: Annotated[Path | None, _file(
        "--tls-ca", "CGROUPD_TLS_CA", "CA bundle that signed the server certificate.")] = None,
    tls_first: Annotated[bool, typer.Option(
        "--tls-first", envvar="CGROUPD_TLS_FIRST",
        help="TLS handshake before the server's INFO (server tls handshake_first).")
    ] = False,
    context: Annotated[str | None, typer.Option(
        "--context", envvar=["CGROUPD_CONTEXT", "NATS_CONTEXT"], metavar="NAME",
        help="Start from this `nats` CLI context (~/.config/nats/context/NAME.json); "
             "options given here override it. Default: the selected context, if any.")
    ] = None,
    js_domain: Annotated[str | None, typer.Option(
        "--js-domain", envvar="CGROUPD_JS_DOMAIN", metavar="DOMAIN",
        help="JetStream domain: API requests go to $JS.DOMAIN.API (leaf nodes, hubs).")
    ] = None,
    inbox_prefix: Annotated[str | None, typer.Option(
        "--inbox-prefix", envvar="CGROUPD_INBOX_PREFIX", metavar="SUBJECT",
        help="Prefix of reply subjects (default _INBOX): e.g. _INBOX_<member>, so that "
             "a member's NATS user may subscribe to its own replies only "
             "(docs/security.md).")] = None,
    connect_timeout: Annotated[float, typer.Option(
        "--connect-timeout", envvar="CGROUPD_CONNECT_TIMEOUT", min=0.1, metavar="SEC",
        help="Give up connecting after this long.")] = DEFAULT_CONNECT_TIMEOUT,
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, expose_value=False,
        help="Print the version and exit.")] = False,
) -> None:
    _state["debug"] = debug
    logs.configure("debug" if debug else "warning")
    explicit = {"servers": tuple(server or ()), "creds": creds, "nkey_seed": nkey,
                "token": token, "user": user, "password": password, "tls_cert": tls_cert,
                "tls_key": tls_key, "tls_ca": tls_ca, "tls_first": tls_first,
                "js_domain": js_domain, "inbox_prefix": inbox_prefix}
    connection = with_context({k: v for k, v in explicit.items() if v}, context, os.environ,
                              connect_timeout=connect_timeout)
    ctx.obj = Globals(connection, json_output, debug)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point."""
    # Run as the process itself (not inside a caller): `join` may become a lean process.
    join.LEAN["exec"] = argv is None
    typer.main.get_command(app).main(args=argv, prog_name=PROG)
