"""Arguments that many commands take, declared once (name, metavar, help)."""

from __future__ import annotations

from typing import Annotated

import typer

#: The origin stream a group belongs to: the first argument of every group command.
Stream = Annotated[str, typer.Argument(metavar="STREAM", help="Origin stream.")]
#: The group: the second argument of every group command.
Group = Annotated[str, typer.Argument(metavar="GROUP", help="Group name.")]
