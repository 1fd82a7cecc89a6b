"""``cgroupd`` from another checkout of the code, so two revisions run side by side in one
benchmark run (on a shared, noisy machine only ratios taken in one run mean anything).

A *baseline* is a directory holding another revision's ``cgroupd/`` package. A benchmark
given ``--baseline PATH`` starts the ``cgroupd join`` processes of its baseline rows
through :func:`run`, which puts PATH first on ``sys.path`` before ``cgroupd`` is imported;
everything else (the server, the traffic, the recording handlers of :mod:`bench.handlers`,
the checks) stays the current tree's, because ``bench`` is imported from the current tree
before PATH is added. The current rows go through the same launcher with the current tree
as PATH, so both sides start the same way. Each process writes the ``cgroupd.__file__`` it
imported to ``$BENCH_CGROUPD_FILE``, so a result can show where its code came from.

Make a baseline (either works):

- ``python -m bench.revision checkout REV DIR``: ``git archive REV cgroupd | tar -x -C DIR``
  plus ``DIR/REVISION`` (the short hash, the baseline's name in the results);
- ``git worktree add --detach DIR REV``: a full checkout, named by
  ``git -C DIR rev-parse --short HEAD`` (``-dirty`` when its ``cgroupd/`` has changes);
  remove it afterwards with ``git worktree remove DIR``.

Usage: ``python -m bench.revision run PATH -- <cgroupd arguments>`` (what the benchmarks
run), ``python -m bench.revision checkout REV DIR``, ``python -m bench.revision name PATH``.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

#: Where a launched process writes the ``cgroupd.__file__`` it imported.
MARKER_ENV = "BENCH_CGROUPD_FILE"
#: The file :func:`checkout` writes: the revision's short hash.
REVISION_FILE = "REVISION"


def check(path: Path) -> Path:
    """``path`` resolved, or ValueError when it holds no ``cgroupd`` package."""
    resolved = Path(path).resolve()
    if not (resolved / "cgroupd" / "__init__.py").is_file():
        raise ValueError(f"{path} holds no cgroupd/ package (make one with "
                         "`python -m bench.revision checkout REV DIR`)")
    return resolved


def _git(*args: str, cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                              check=False)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def name(path: Path) -> str:
    """The baseline's name in results: the short hash of the git checkout at ``path``
    (``-dirty`` when its ``cgroupd/`` differs from that commit), else what
    :func:`checkout` wrote in ``REVISION``, else the directory's name."""
    path = Path(path).resolve()
    top = _git("-C", str(path), "rev-parse", "--show-toplevel")
    if top is not None and Path(top).resolve() == path:
        short = _git("-C", str(path), "rev-parse", "--short", "HEAD")
        if short:
            dirty = _git("-C", str(path), "status", "--porcelain", "--", "cgroupd")
            return short + ("-dirty" if dirty else "")
    marker = path / REVISION_FILE
    if marker.is_file():
        written = marker.read_text().strip()
        if written:
            return written
    return path.name


def checkout(rev: str, directory: Path, repo: Path | None = None) -> str:
    """Extract ``rev``'s ``cgroupd/`` (from the git repository at ``repo``, by default
    the one holding this file) into ``directory``; its short hash, also written to
    ``directory/REVISION``. ValueError for an unknown revision or a used directory."""
    repo = repo or Path(__file__).resolve().parent.parent
    short = _git("rev-parse", "--short", f"{rev}^{{commit}}", cwd=repo)
    if short is None:
        raise ValueError(f"{rev!r} is not a commit of {repo}")
    directory = Path(directory)
    if (directory / "cgroupd").exists():
        raise ValueError(f"{directory / 'cgroupd'} exists already")
    directory.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(["git", "archive", short, "cgroupd"], cwd=repo,
                               stdout=subprocess.PIPE)
    assert archive.stdout is not None
    untar = subprocess.run(["tar", "-x", "-C", str(directory)], stdin=archive.stdout,
                           check=False)
    archive.stdout.close()
    if archive.wait() != 0 or untar.returncode != 0:
        raise RuntimeError(f"git archive {short} cgroupd | tar -x -C {directory} failed")
    (directory / REVISION_FILE).write_text(short + "\n")
    return short


def run(path: str, argv: list[str]) -> None:
    """``python -m cgroupd ARGV`` with the ``cgroupd`` package taken from ``path``."""
    if "cgroupd" in sys.modules:  # imported before PATH was first: the wrong revision
        sys.exit("bench.revision: cgroupd was imported before the baseline path was added")
    where = str(check(Path(path)))
    sys.path.insert(0, where)
    import cgroupd

    imported = str(Path(cgroupd.__file__ or "").resolve())
    if not imported.startswith(where + os.sep):
        sys.exit(f"bench.revision: cgroupd came from {imported}, not from {where}")
    marker = os.environ.get(MARKER_ENV)
    if marker:
        Path(marker).write_text(imported + "\n")
    sys.argv = ["cgroupd", *argv]
    runpy.run_module("cgroupd", run_name="__main__", alter_sys=True)


def launcher(path: Path) -> tuple[str, ...]:
    """What :class:`bench.common.Members` runs instead of ``-m cgroupd``."""
    return ("-m", "bench.revision", "run", str(path), "--")


def main(argv: list[str]) -> int:
    usage = ("usage: python -m bench.revision run PATH -- <cgroupd arguments> | "
             "checkout REV DIR | name PATH")
    if len(argv) >= 3 and argv[0] == "run" and argv[2] == "--":
        try:
            run(argv[1], argv[3:])
        except ValueError as exc:
            sys.exit(f"bench.revision: {exc}")
        return 0
    try:
        if len(argv) == 3 and argv[0] == "checkout":
            print(checkout(argv[1], Path(argv[2])))
            return 0
        if len(argv) == 2 and argv[0] == "name":
            print(name(check(Path(argv[1]))))
            return 0
    except (ValueError, RuntimeError) as exc:
        print(f"bench.revision: {exc}", file=sys.stderr)
        return 2
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
