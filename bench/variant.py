"""``cgroupd`` with other defaults for settings the command line does not expose.

To measure a proposed default (a longer pull expiry, a slower heartbeat) before anyone
changes the code: ``MemberSettings`` fields given here replace the built-in defaults
for this process; options given on the command line still win. Values are parsed as
Python literals (numbers, booleans).

Usage: ``python -m bench.variant 'pull_expires=5,heartbeat=1' -- <cgroupd arguments>``.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from typing import Any


def parse(spec: str) -> dict[str, Any]:
    """``name=value,...`` into settings, refusing names ``MemberSettings`` lacks."""
    from cgroupd.core.settings import MemberSettings

    known = {f.name for f in dataclasses.fields(MemberSettings)}
    out: dict[str, Any] = {}
    for part in filter(None, spec.split(",")):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in known:
            raise SystemExit(f"bench.variant: {part!r} is not NAME=VALUE of a member setting "
                             f"({', '.join(sorted(known))})")
        out[name] = ast.literal_eval(value.strip())
    return out


def run(spec: str, argv: list[str]) -> None:
    from cgroupd import cli
    from cgroupd.cli import join
    from cgroupd.core.settings import MemberSettings

    overrides = parse(spec)

    def settings(**given: Any) -> MemberSettings:
        return MemberSettings(**(overrides | given))

    # Where `join` builds its settings (the package attribute alone changed nothing).
    setattr(join, "MemberSettings", settings)  # noqa: B010 - replaced at run time on purpose
    cli.main(argv)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        sys.exit("usage: python -m bench.variant NAME=VALUE[,...] -- <cgroupd arguments>")
    run(sys.argv[1], sys.argv[3:])
