"""The command line's pure parts, without a server: the parsers, the help defaults derived
from MemberSettings, and the one place that turns errors into exit codes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import cgroupd.cli
from cgroupd.cli import app
from cgroupd.cli.application import exit_code_for
from cgroupd.cli.errors import CliError, UsageError, bad_arguments
from cgroupd.cli.parsers import join_missing, pair_filters, parse_wildcards
from cgroupd.core.errors import ConfigError, GroupNotFound, ServerUnreachable
from cgroupd.core.settings import MemberSettings
from cgroupd.join.handlers import HandlerLoadError

CLI = Path(cgroupd.cli.__file__).parent


def _join_help() -> str:
    result = CliRunner().invoke(app, ["join", "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return " ".join(result.stdout.split())  # wrapping apart


def _shown_default(text: str, row: str) -> str:
    """The ``[default: ...]`` of the help row that starts with ``row``."""
    match = re.search(re.escape(row) + r" (?:(?!\[env var).)*?\[default: ([^\]]+)\]", text)
    assert match, f"no default shown for {row}"
    return match.group(1)


def test_join_help_defaults_are_the_member_settings_defaults() -> None:
    """Every default `join --help` promises is what MemberSettings does when the option
    is not given (a default changed in settings.py cannot leave the help behind)."""
    text = _join_help()
    defaults = MemberSettings()
    for row, field in [("--ack-wait SEC", "ack_wait"),
                       ("--retry-interval SEC", "retry_interval"),
                       ("--inactive-threshold SEC", "inactive_threshold"),
                       ("--drain-timeout SEC", "drain_timeout")]:
        assert float(_shown_default(text, row)) == getattr(defaults, field), row
    assert _shown_default(text, "--ordering <partition|key|stream|none>") == \
        defaults.ordering.value
    assert _shown_default(text, "--key SPEC") == defaults.key
    assert _shown_default(text, "--exclusivity <sync|pinned>") == defaults.exclusivity.value
    assert int(_shown_default(text, "--max-in-flight N")) == defaults.max_in_flight


def test_join_sources_restate_no_member_settings_default() -> None:
    """The join command's source holds no literal ``[default: N]`` of a MemberSettings
    number: they are all derived."""
    source = (CLI / "join.py").read_text()
    assert re.findall(r"\[default: \d", source) == []


def test_parsers_do_no_io() -> None:
    """cgroupd.cli.parsers imports nothing that reads or writes: text in, values out."""
    tree = ast.parse((CLI / "parsers.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert imported <= {"__future__", "re", "collections.abc", "datetime",
                        "cgroupd.core.config"}, imported


def test_only_the_app_turns_errors_into_exit_codes() -> None:
    """Commands raise or return a code; none prints an error line or exits itself."""
    for path in sorted(CLI.glob("*.py")):
        if path.name == "application.py":
            continue
        source = path.read_text()
        for forbidden in ("sys.exit", "typer.Exit", "raise SystemExit", "error: ",
                          "_error_line"):
            assert forbidden not in source, f"{path.name} uses {forbidden}"


@pytest.mark.parametrize(("exc", "code", "line"), [
    (UsageError("give --a or --b, not both"), 2, "give --a or --b, not both"),
    (ConfigError(["partitions must be positive", "bad name"]), 2,
     "partitions must be positive; bad name"),
    (HandlerLoadError("no module named x"), 2, "no module named x"),
    (CliError("not deleted"), 1, "not deleted"),
    (GroupNotFound("no consumer group S/g"), 1, "no consumer group S/g"),
    (ServerUnreachable("cannot connect to nats://x:1:\nrefused"), 1,
     "cannot connect to nats://x:1: refused"),
    (RuntimeError("boom"), 1,
     "unexpected RuntimeError: boom (run with --debug for the traceback)"),
    (KeyboardInterrupt(), 130, "interrupted"),
    (typer.Abort(), 1, "aborted"),
])
def test_exit_codes_and_one_line(exc: BaseException, code: int, line: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Each kind of error gets its documented exit code and exactly one stderr line."""
    assert exit_code_for(exc) == code
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"cgroupd: error: {line}\n"


def test_system_exit_keeps_its_code(capsys: pytest.CaptureFixture[str]) -> None:
    """An exit a library raised passes through, silently."""
    assert exit_code_for(SystemExit(3)) == 3
    assert exit_code_for(SystemExit(None)) == 0
    assert exit_code_for(SystemExit("text")) == 1
    assert capsys.readouterr() == ("", "")


def test_bad_arguments_turns_value_errors_into_usage_errors() -> None:
    """A ValueError inside becomes a UsageError with the same message; others pass."""
    with pytest.raises(UsageError, match=r"^bad value$"), bad_arguments():
        raise ValueError("bad value")
    with pytest.raises(KeyError), bad_arguments():
        raise KeyError("not an argument problem")


def test_parse_wildcards() -> None:
    """Positions like 1 or 1,2 (spaces and empty items ignored); anything else refused."""
    assert parse_wildcards("1") == (1,)
    assert parse_wildcards(" 1, 2,") == (1, 2)
    for bad in ("", ",", "a", "1,x", "-1", "1.5"):
        with pytest.raises(ValueError, match="wildcard positions"):
            parse_wildcards(bad)


def test_pair_filters_edges() -> None:
    """--filter=X form, arguments after -- ignored, a trailing --filter without a value
    left to click, and --wildcards before any --filter refused."""
    assert pair_filters(["--filter=a.*", "--wildcards=1", "--", "--filter", "b"]) == [
        ("a.*", "1")]
    assert pair_filters(["--filter"]) == []
    with pytest.raises(ValueError, match="must follow the --filter"):
        pair_filters(["--wildcards", "1", "--filter", "a.*"])


def test_join_missing() -> None:
    """Nothing missing: None; one missing: singular wording; hostname replaces member."""
    def missing(member: str | None = "m1", hostname: int | None = None,
                group: str | None = "g") -> str | None:
        return join_missing(stream="S", group=group, member=member,
                            member_from_hostname=hostname, handler=None, webhook="http://x")

    assert missing() is None
    assert missing(member=None, hostname=3) is None
    assert missing(group=None) == "join is missing 1 option: --group GROUP"
