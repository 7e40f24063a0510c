"""Server addresses as users write them: checked once, and never shown or stored with their credentials.

`http://user:secret@host:8000/v1` is a valid address (httpx sends the user and password as basic auth), but
the secret must not reach a report, a log, the CI step summary or an error message: everything tokq prints or
writes names a server by `redact(url)` (`http://***@host:8000/v1`). A malformed address (a bad IPv6 literal,
a port that is no number, no host) is a one-line ConfigError naming it, not a traceback from deep in httpx.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from tokq.errors import ConfigError

_USERINFO = re.compile(r"(?<=://)[^/@?#]*@")


def redact(text: str) -> str:
    """`text` with the user:password part of every URL in it replaced by ***."""
    return _USERINFO.sub("***@", text)


def check_http_url(url: str, what: str = "the URL") -> str:
    """`url` if it is an http(s) address with a host and a valid port; else a ConfigError (credentials redacted)."""
    shown = redact(url)
    example = "e.g. http://127.0.0.1:8000/v1"
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{what} {shown!r} is not an http(s) address: {example}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is no number or out of range
    except ValueError as exc:
        raise ConfigError(f"{what} {shown!r} is malformed ({redact(str(exc))}): {example}") from None
    if not parts.hostname:
        raise ConfigError(f"{what} {shown!r} names no host: {example}")
    if any(c.isspace() for c in url):
        raise ConfigError(f"{what} {shown!r} holds white space: {example}")
    return url


def split_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    """(the URL without user:password, (user, password) or None)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal keeps its brackets
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port is not None else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)), \
        (parts.username or "", parts.password or "")
