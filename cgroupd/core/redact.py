"""One place that hides secrets a URL carries, used by everything that prints a URL.

A NATS server URL may hold a user and password or a token (``nats://user:pw@host``,
``nats://TOKEN@host``), a webhook URL basic-auth credentials. Whatever is printed (log
lines, CLI errors, ``--json``, metric labels) goes through :func:`redact_url` or
:func:`redact_text` first. The whole userinfo is replaced, user name included: in
``nats://TOKEN@host`` the "user" is the secret. A webhook URL is shown as
:func:`safe_url`: no userinfo, and its query (often a signature) reduced to ``?...``.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

#: What replaces a URL's userinfo.
MASK = "***"

# scheme://userinfo@ ; the userinfo runs to the last '@' before the path (a password may
# hold an unescaped '@', as urllib reads it).
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)[^/?#\s]*@")


def redact_url(url: str) -> str:
    """``url`` with any ``user:password@`` / ``token@`` replaced by ``***@``."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", url)


def redact_text(text: str) -> str:
    """``text`` with the userinfo of every URL in it replaced (cheap when there is none)."""
    if "://" not in text or "@" not in text:
        return text
    return _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)


def safe_url(url: str) -> str:
    """``url`` as it may be shown (logs, errors, dead letters): no userinfo, and a query
    string (often a signature or token) reduced to ``?...``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "..." if parts.query else "", ""))
