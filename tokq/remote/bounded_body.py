"""An HTTP answer read within bounds: a total deadline and a cap on its decoded size (remote/http.py uses it).

httpx's timeouts are per read, so a server trickling a byte a second never trips them: the body is read in
chunks against the call's own deadline. httpx's decoders inflate a whole network chunk in one call (64 KB of a
gzip bomb -> 64 MB at once; a 300 MB bomb took a client to 982 MB): here the raw bytes are inflated a piece of at
most PIECE bytes at a time, the size checked after each, so memory stays near the cap whatever the server sends.
Only the encodings the client offers (gzip, deflate) are read; another is refused.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import httpx

PIECE = 1 << 16  # decoded bytes per decompression step


class Deadline(Exception):
    """The call's total deadline passed while the answer was still arriving."""


class TooLarge(Exception):
    """The decoded answer grew past its cap."""


class Encoding(Exception):
    """An answer in a content encoding the client did not offer."""


class _Decoder:
    """Raw bytes -> content, PIECE bytes at most per step."""

    def __init__(self, encoding: str):
        encoding = encoding.strip().lower()
        if encoding in ("", "identity"):
            self.inflate = None
        elif encoding in ("gzip", "x-gzip", "deflate"):
            self.inflate = zlib.decompressobj(15 + 32)  # zlib or gzip header, detected
        else:
            raise Encoding(encoding)

    def feed(self, raw: bytes) -> Iterator[bytes]:
        if self.inflate is None:
            yield raw
            return
        data = raw
        while data:
            yield self.inflate.decompress(data, PIECE)
            data = self.inflate.unconsumed_tail

    def close(self) -> Iterator[bytes]:
        if self.inflate is not None:
            yield self.inflate.flush()


class _Body:
    """The pieces read so far, against the cap and the deadline (`remaining()`: seconds left)."""

    def __init__(self, response: httpx.Response, max_bytes: int, remaining: Callable[[], float]):
        self.decoder = _Decoder(response.headers.get("content-encoding", ""))
        self.max_bytes, self.remaining = max_bytes, remaining
        self.pieces: list[bytes] = []
        self.size = 0

    def take(self, pieces) -> None:
        for piece in pieces:
            self.pieces.append(piece)
            self.size += len(piece)
            if self.size > self.max_bytes:
                raise TooLarge
            if self.remaining() <= 0:
                raise Deadline


def read_bounded(response: httpx.Response, max_bytes: int, remaining: Callable[[], float]) -> bytes:
    """The decoded body of a response opened with stream=True (raises TooLarge, Deadline, Encoding, zlib.error)."""
    body = _Body(response, max_bytes, remaining)
    for raw in response.iter_raw():
        body.take(body.decoder.feed(raw))
    body.take(body.decoder.close())
    return b"".join(body.pieces)


async def aread_bounded(response: httpx.Response, max_bytes: int, remaining: Callable[[], float]) -> bytes:
    """read_bounded for an async response."""
    body = _Body(response, max_bytes, remaining)
    async for raw in response.aiter_raw():
        body.take(body.decoder.feed(raw))
    body.take(body.decoder.close())
    return b"".join(body.pieces)
