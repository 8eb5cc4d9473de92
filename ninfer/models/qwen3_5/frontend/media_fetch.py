"""http(s) image URLs, fetched only from the hosts an operator lists (`serve --allow-media-urls`).

A client's URL makes the server open a connection, so the policy is narrow (issue 18): http and
https only (never file:// or any other scheme), the URL's host must be listed, every redirect is
checked against the same list (a listed host cannot bounce the fetch elsewhere), the body is
capped in bytes, and the whole fetch (redirects, connect, headers, body) in seconds. http.client
directly, not urllib: no proxy from the environment, no automatic redirects, no other schemes.
Every failure is a MediaError (a 400 with the reason)."""
from __future__ import annotations

import http.client
import socket
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from .image_preprocess import MediaError

OPTION = "--allow-media-urls"
_REDIRECTS = (301, 302, 303, 307, 308)


def _host_port(netloc_or_url: str, default_port: int | None):
    parts = urlsplit(netloc_or_url if "//" in netloc_or_url else "//" + netloc_or_url)
    try:
        port = parts.port
    except ValueError:
        raise MediaError(f"{netloc_or_url!r} has a bad port") from None
    return (parts.hostname or "").lower(), port if port is not None else default_port


@dataclass(frozen=True)
class MediaUrlPolicy:
    """Which image URLs the Frontend fetches. `hosts`: 'name' (any port) or 'name:port'."""
    hosts: tuple
    max_bytes: int = 20 << 20
    timeout_s: float = 10.0
    max_redirects: int = 3

    @classmethod
    def parse(cls, text: str, **limits) -> "MediaUrlPolicy":
        """'HOST,HOST:PORT,...' (the serve option). ValueError for an empty or malformed entry."""
        hosts = tuple(h.strip() for h in text.split(","))
        for h in hosts:
            if not h or "/" in h or "@" in h or not _host_port(h, None)[0]:
                raise ValueError(f"{OPTION} {text!r}: each entry must be a host name or "
                                 "host:port, separated by commas")
        return cls(hosts, **limits)

    def allows(self, host: str, port: int) -> bool:
        for entry in self.hosts:
            h, p = _host_port(entry, None)
            if h == host and (p is None or p == port):
                return True
        return False

    def fetch(self, url: str, what: str = "image") -> bytes:
        """The body of a 200 answer at `url` (following redirects to listed hosts only); `what`
        names the medium in errors."""
        deadline = time.monotonic() + self.timeout_s
        shown = url if len(url) <= 200 else url[:200] + "..."
        for _ in range(self.max_redirects + 1):
            scheme = urlsplit(url).scheme.lower()
            if scheme not in ("http", "https"):
                raise MediaError(f"{what} URL {shown!r}: only http(s) URLs are fetched")
            host, port = _host_port(url, 443 if scheme == "https" else 80)
            if not self.allows(host, port):
                raise MediaError(f"{what} URL {shown!r}: host {host!r} (port {port}) is not "
                                 f"among the server's {OPTION} hosts")
            try:
                status, location, body = self._get(url, scheme, host, port, deadline, what)
            except MediaError:
                raise
            except (socket.timeout, TimeoutError):
                raise MediaError(f"{what} URL {shown!r}: no complete answer within "
                                 f"{self.timeout_s:g} s") from None
            except (OSError, http.client.HTTPException, ssl.SSLError) as e:
                raise MediaError(f"{what} URL {shown!r}: {type(e).__name__}: {e}") from None
            if status in _REDIRECTS:
                if not location:
                    raise MediaError(f"{what} URL {shown!r}: HTTP {status} without a Location")
                url = urljoin(url, location)
                shown = url if len(url) <= 200 else url[:200] + "..."
                continue
            if status != 200:
                raise MediaError(f"{what} URL {shown!r}: HTTP {status}")
            return body
        raise MediaError(f"{what} URL {shown!r}: more than {self.max_redirects} redirects")

    def _get(self, url, scheme, host, port, deadline, what):
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        conn = cls(host, port, timeout=left)
        try:
            conn.connect()
            sock = conn.sock            # kept: getresponse may drop conn.sock (Connection: close)
            parts = urlsplit(url)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("GET", target, headers={"User-Agent": "ninfer", "Accept": f"{what}/*"})
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            resp = conn.getresponse()
            if resp.status in _REDIRECTS:
                return resp.status, resp.getheader("Location"), b""
            if resp.status != 200:
                return resp.status, None, b""
            length = resp.getheader("Content-Length")
            if length and length.strip().isdigit() and int(length) > self.max_bytes:
                raise MediaError(f"{what} URL {url!r}: {int(length)} bytes, over the "
                                 f"{self.max_bytes}-byte limit")
            body = bytearray()
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout
                sock.settimeout(left)   # each read gets only the time the whole fetch has left
                chunk = resp.read1(1 << 16)
                if not chunk:
                    return 200, None, bytes(body)
                body += chunk
                if len(body) > self.max_bytes:
                    raise MediaError(f"{what} URL {url!r}: the body is over the "
                                     f"{self.max_bytes}-byte limit")
        finally:
            conn.close()
