"""The ``cgroupd`` command line without a server: its pure parsers and table, and the
argument checks of ``join``, which fail before connecting (the admin round trips, with a
real nats-server, are in tests/integration/test_cli.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cgroupd.cli.parsers import (
    member_from_hostname,
    pair_filters,
    parse_mappings,
    parse_partitions,
)
from cgroupd.views import ranges, table
from tests.support.cli import (
    assert_one_line_error,
    child_env,
    cli,
    restore_logging,  # noqa: F401 - autouse fixture
)


# -- pure helpers -----------------------------------------------------------------------
def test_member_from_hostname() -> None:
    """StatefulSet ordinals map onto members round-robin; others are refused."""
    assert member_from_hostname("worker-0", 3) == "m0"
    assert member_from_hostname("worker-4", 3) == "m1"
    assert member_from_hostname("my-app-worker-5.workers.ns.svc.cluster.local", 3) == "m2"
    assert member_from_hostname("worker-7", 1, prefix="member-") == "member-0"
    for bad, members in (("worker", 3), ("worker-x", 3), ("worker-1", 0), ("", 2)):
        with pytest.raises(ValueError):
            member_from_hostname(bad, members)
    with pytest.raises(ValueError, match="must not contain"):
        member_from_hostname("w-1", 2, prefix="a.b")


def test_mapping_and_partition_syntax() -> None:
    """Lists, ranges and their mistakes."""
    assert parse_partitions("0,1,4-6") == (0, 1, 4, 5, 6)
    [m1, m2] = parse_mappings(["m1=0-1", "m2=2,3"])
    assert (m1.member, m1.partitions, m2.partitions) == ("m1", (0, 1), (2, 3))
    for bad in (["m1"], ["m1="], ["=0"], ["m1=a"], ["m1=3-1"], ["m1=0,0"], ["m.1=0"], []):
        with pytest.raises(ValueError):
            parse_mappings(bad)
    assert ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and ranges([]) == "-"


def test_filter_pairing_follows_command_line_order() -> None:
    """Each --wildcards belongs to the --filter before it."""
    args = ["S", "G", "--filter", "a.*.*", "--wildcards", "1,2", "--partitions", "3",
            "--filter=b.*", "--filter", "c.>", "--wildcards=1"]
    assert pair_filters(args) == [("a.*.*", "1,2"), ("b.*", None), ("c.>", "1")]
    with pytest.raises(ValueError, match="must follow"):
        pair_filters(["--wildcards", "1", "--filter", "a.*"])
    with pytest.raises(ValueError, match="more than one"):
        pair_filters(["--filter", "a.*", "--wildcards", "1", "--wildcards", "1"])


def test_table_aligns_columns() -> None:
    assert table(["A", "LONGER"], [("xyz", 1)]) == "A    LONGER\nxyz  1"


# -- join's argument checks -------------------------------------------------------------
def test_join_names_what_is_missing_in_the_order_people_add_it() -> None:
    """A newcomer's `cgroupd join --stream X --group g` learns first that a member is
    missing (or the hostname derivation that replaces it), and in the same message that a
    handler is too; each missing option is named once, in the order people add them."""
    member = "--member MEMBER (or --member-from-hostname MEMBERS"
    handler = "--handler PKG.MODULE:FUNCTION or --webhook URL"
    result = cli(None, "join", "--stream", "X", "--group", "g")
    assert_one_line_error(result, 2, "join is missing 2 options: ", member, handler)
    err = result.stderr
    assert err.index(member) < err.index(handler), err
    assert "exactly one" not in err
    result = cli(None, "join")
    assert_one_line_error(result, 2, "missing 4 options: --stream STREAM; --group GROUP; "
                          + member, handler)
    # Environment variables count as given, the hostname derivation replaces --member.
    result = cli(None, "join", env={"CGROUPD_STREAM": "X", "CGROUPD_MEMBERS": "3"})
    assert_one_line_error(result, 2, "missing 2 options: --group GROUP; " + handler)
    assert "--member" not in result.stderr
    # The real command, as a person runs it: same line, exit 2, nothing on stdout.
    proc = subprocess.run([sys.executable, "-m", "cgroupd", "join", "--stream", "X",
                           "--group", "g"], capture_output=True, text=True,
                          env=child_env(), timeout=60)
    assert proc.returncode == 2, proc
    assert proc.stdout == ""
    assert proc.stderr.strip() == ("cgroupd: error: join is missing 2 options: " + member
                                   + " to derive it from a StatefulSet pod name); "
                                   + handler), proc.stderr


def test_member_from_hostname_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """--member-from-hostname (CGROUPD_MEMBERS) derives the member from the pod name;
    a hostname without an ordinal, or both ways at once, is a usage error."""
    import cgroupd.cli.join

    join = ["join", "--stream", "S", "--group", "g", "--webhook", "http://127.0.0.1:1/x"]
    monkeypatch.setattr(cgroupd.cli.join.socket, "gethostname", lambda: "worker")
    assert_one_line_error(cli(None, *join, "--member-from-hostname", "3"), 2,
                          "does not end in -<ordinal>")
    assert_one_line_error(cli(None, *join, env={"CGROUPD_MEMBERS": "3"}), 2,
                          "does not end in -<ordinal>")
    assert_one_line_error(cli(None, *join, "--member", "m1", env={"CGROUPD_MEMBERS": "3"}),
                          2, "not both")
    monkeypatch.setattr(cgroupd.cli.join.socket, "gethostname", lambda: "worker-4.workers.ns")
    # Ordinal 4 of 3 members is m1: shown here through the name check of the prefix.
    assert_one_line_error(cli(None, *join, "--member-from-hostname", "3",
                              "--member-prefix", "a."), 2, "member name 'a.1'")


def test_webhook_events_needs_a_webhook() -> None:
    """--webhook-events without --webhook is a usage error naming the handler module's
    hooks instead."""
    join = ["join", "--stream", "S", "--group", "g", "--member", "m1", "--handler",
            "tests.support.handlers.listener_handler:handle", "--webhook-events"]
    assert_one_line_error(cli(None, *join), 2, "--webhook-events needs --webhook")
