"""Issue 25 row 4: ``--webhook-ca`` (a private CA) and ``--webhook-cert/--webhook-key``
(mutual TLS) against a real local HTTPS webhook, with a throwaway CA made by ``openssl``
for the test; and the option checks that refuse unusable files without showing them."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from nats.aio.client import Client

from cgroupd.core.errors import ConfigError, WebhookFailed
from cgroupd.join.handlers import AuthHeaders, WebhookHandler, WebhookOptions
from cgroupd.nats.jetstream import JetStream
from tests.support.cli import (
    JoinProcess,
    assert_one_line_error,
    cli,
    restore_logging,  # noqa: F401 - autouse fixture
)
from tests.support.groups import make_group
from tests.support.natsserver import NatsServer, find_free_port
from tests.support.polling import eventually

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.pem/ca.key, server.pem/server.key (for 127.0.0.1), client.pem/client.key."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.pem", "-days", "2", "-subj", "/CN=cgroupd test CA", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"),
                      ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile",
                 f"{name}.ext", cwd=d)
    return d


@pytest_asyncio.fixture
async def https_hook(pki: Path) -> AsyncIterator[tuple[str, list[str]]]:
    """An HTTPS webhook that wants a client certificate from the test CA; yields its URL
    and the common names of the clients it served."""
    seen: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        cert = request.transport.get_extra_info("peercert") if request.transport else None
        seen.append(dict(x[0] for x in cert["subject"])["commonName"] if cert else "?")
        return web.Response(text="ok")

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki / "ca.pem"))
    ctx.load_cert_chain(pki / "server.pem", pki / "server.key")
    ctx.verify_mode = ssl.CERT_REQUIRED
    app = web.Application()
    app.router.add_post("/hook", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = find_free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=ctx).start()
    try:
        yield f"https://127.0.0.1:{port}/hook", seen
    finally:
        await runner.cleanup()


async def _call(options: WebhookOptions) -> None:
    from tests.unit.test_handlers import message

    ctx = options.ssl_context()
    connector = aiohttp.TCPConnector(ssl=ctx if ctx else True)
    async with aiohttp.ClientSession(connector=connector) as session:
        await WebhookHandler(options, session)(message())


async def test_private_ca_and_client_certificate(pki: Path,
                                                 https_hook: tuple[str, list[str]]) -> None:
    """Without --webhook-ca the webhook's certificate is refused (retried, not acked);
    with the CA but no client certificate the webhook refuses us; with both it is
    called and sees our client certificate."""
    url, seen = https_hook
    with pytest.raises(WebhookFailed, match="certificate verify failed"):
        await _call(WebhookOptions(url))
    with pytest.raises(WebhookFailed):
        await _call(WebhookOptions(url, ca_file=str(pki / "ca.pem")))
    assert seen == []
    await _call(WebhookOptions(url, ca_file=str(pki / "ca.pem"),
                               cert_file=str(pki / "client.pem"),
                               key_file=str(pki / "client.key")))
    assert seen == ["client"]


@pytest.mark.slow
async def test_join_calls_an_https_webhook_with_mutual_tls(
        nats_server: NatsServer, jetstream: JetStream, nc: Client, tmp_path: Path,
        pki: Path, https_hook: tuple[str, list[str]]) -> None:
    """The same through a real ``cgroupd join`` (options from CGROUPD_* variables for the
    certificate files, as a container would set them): the message is acked."""
    url, seen = https_hook
    await make_group(jetstream, partitions=1, members=("m1",))
    proc = JoinProcess(nats_server.url, tmp_path, "join", "--stream", "ORDERS", "--group",
                       "g", "--member", "m1", "--webhook", url,
                       "--webhook-ca", str(pki / "ca.pem"),
                       "--webhook-cert", str(pki / "client.pem"),
                       "--webhook-key", str(pki / "client.key"))
    try:
        await nc.jetstream().publish("orders.k1", json.dumps({"key": "k1"}).encode())
        async with aiohttp.ClientSession() as http:
            async def acked() -> bool:
                return await proc.metric(http, "cgroupd_messages_processed_total",
                                         outcome="ack") == 1

            await eventually(acked, 20, what="the message acked", diagnostics=proc.log_tail)
    finally:
        proc.close()
    assert seen == ["client"]


def test_unusable_credential_files_are_usage_errors_that_show_no_value(tmp_path: Path) -> None:
    """A missing token file, a header file with a bad line, a certificate that is not
    one: exit 2 naming the file (and line), never the file's contents."""
    secret = "s3cr3t-value-never-shown"
    bad_headers = tmp_path / "headers"
    bad_headers.write_text(f"Authorization: Bearer ok\n{secret} no colon\n")
    bad_cert = tmp_path / "cert.pem"
    bad_cert.write_text(f"-----BEGIN CERTIFICATE-----\n{secret}\n")
    base = ("join", "--stream", "S", "--group", "g", "--member", "m", "--webhook",
            "http://127.0.0.1:9/hook")
    for extra, fragments in [
        (("--webhook-token-file", str(tmp_path / "missing")),
         ("cannot read", "missing", "No such file")),
        (("--webhook-header-file", str(bad_headers)), ("line 2 of", "not a 'Name: value'")),
        (("--webhook-ca", str(bad_cert)), ("--webhook-ca", "cert.pem")),
    ]:
        result = cli(None, *base, *extra)
        assert_one_line_error(result, 2, *fragments)
        assert secret not in result.output
    result = cli(None, "join", "--stream", "S", "--group", "g", "--member", "m",
                 "--handler", "x:y", "--webhook-token-file", str(tmp_path / "t"))
    assert_one_line_error(result, 2, "need --webhook")
    result = cli(None, *base[:-1], f"http://u:{secret}@127.0.0.1:9/h",
                 "--webhook-token-file", str(bad_headers))
    assert_one_line_error(result, 2, "credentials once")
    assert secret not in result.output


def test_options_never_show_credentials(tmp_path: Path) -> None:
    """repr() of the options (debug output, tracebacks) and every URL shown carry no
    userinfo or query; userinfo becomes Basic auth; a token file a Bearer header, re-read
    once it changes."""
    options = WebhookOptions("https://svc:p%40ss-word@hooks.example:8443/in?sig=abcdef#x")
    assert "p%40ss" not in repr(options) and "abcdef" not in repr(options)
    assert options.display_url == "https://hooks.example:8443/in?..."
    assert options.endpoint == "https://hooks.example:8443/in?sig=abcdef#x"
    assert options.basic_auth == ("svc", "p@ss-word")
    with pytest.raises(ConfigError) as info:
        WebhookOptions("ftp://u:hidden-pw@host/x")
    assert "hidden-pw" not in str(info.value)
    token = tmp_path / "token"
    token.write_text("first-token\n")
    auth = AuthHeaders(WebhookOptions("http://h/x", token_file=str(token)))
    assert auth.current() == {"Authorization": "Bearer first-token"}
    token.write_text("second-token-longer\n")
    assert auth.current() == {"Authorization": "Bearer second-token-longer"}
    token.write_text("")  # a rewrite in progress: the last good token stays
    assert auth.current() == {"Authorization": "Bearer second-token-longer"}
