"""Pure parsers of command-line arguments: text in, a value (or a message) out, no I/O.

Each raises ValueError with a message meant for the user; the commands turn it into a
usage error (exit 2) with :func:`cgroupd.cli.errors.bad_arguments`. Unit-tested in
tests/unit/test_cli_parsing.py, tests/unit/test_views.py and tests/unit/test_cli_parsers.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime

from cgroupd.core.config import MAX_PARTITIONS, MemberMapping, name_problems

#: Most partitions one ``mapping set`` may name: a mapping lists every partition in the
#: record, so a typo like ``m1=0-2000000000`` would write gigabytes.
MAX_MAPPED_PARTITIONS = 65_536

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
        if len(out) + last - first + 1 > MAX_MAPPED_PARTITIONS:
            raise ValueError(f"more than {MAX_MAPPED_PARTITIONS} partitions mapped: a "
                             "mapping lists each one in the record")
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


_IPV6_CHARS = re.compile(r"[0-9A-Fa-f:.]+(%[\w.-]+)?")


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (every address) → ``(host, port)``;
    ValueError otherwise."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen {text!r}: give HOST:PORT, e.g. 127.0.0.1:8480")
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host or not _IPV6_CHARS.fullmatch(host):
            raise ValueError(f"--listen {text!r}: {host!r} is not an IPv6 address")
    elif ":" in host:
        raise ValueError(f"--listen {text!r}: write an IPv6 address in brackets, "
                         "e.g. [::1]:8480")
    return host, int(port)
