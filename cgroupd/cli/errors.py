"""How a command says it cannot go on. Commands only raise; the app
(:mod:`cgroupd.cli.application`) alone turns an error into one line on stderr and an exit
code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class CliError(Exception):
    """An expected failure (exit 1): ``message`` is printed on one line."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UsageError(CliError):
    """Bad arguments, names or combinations of options (exit 2)."""


@contextmanager
def bad_arguments() -> Iterator[None]:
    """A ValueError raised inside (a parser, a settings or options check) is the user's
    argument that is wrong: a usage error with the same message."""
    try:
        yield
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
