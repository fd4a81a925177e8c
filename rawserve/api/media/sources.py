"""An image part's URL -> its encoded bytes: data: (base64), http(s):// fetched here (stdlib asyncio and h11:
a deadline, a size cap, a redirect cap, a content-type check, an optional domain allow-list) and file:// only
under the allowed local directory. Every refusal is an APIError 400 naming the part; nothing here decodes."""
from __future__ import annotations

import asyncio
import base64
import binascii
import os
import ssl
import stat
import urllib.parse
from dataclasses import dataclass

import h11

from rawserve.errors import APIError

MAX_REDIRECTS = 5
MAX_RESPONSE_HEADER_BYTES = 64 * 1024
_READ_BYTES = 64 * 1024
_INLINE_DATA_CHARS = 256 * 1024
_BASE64_SLICE_CHARS = 256 * 1024  # a multiple of 4: each slice decodes alone
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
# Types a server may send for an image it does not label: the decoder decides.
_UNLABELLED = frozenset({"", "application/octet-stream", "binary/octet-stream"})


@dataclass(frozen=True, slots=True)
class SourcePolicy:
    """Where image bytes may come from and how many of them."""
    max_bytes: int  # encoded bytes of one image
    fetch_timeout_s: float
    allowed_domains: tuple[str, ...] = ()  # lower-case host names; empty: any host
    allowed_local_path: str | None = None  # file:// URLs only under this directory; None: no file:// at all
    max_redirects: int = MAX_REDIRECTS


def shown(url: str, limit: int = 80) -> str:
    """A URL as an error message may quote it: a data: URL's payload (or any long URL) cut short."""
    return url if len(url) <= limit else url[:limit] + "..."


async def image_bytes(url: str, param: str, policy: SourcePolicy) -> bytes:
    """The encoded image at `url`."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        if len(url) > _INLINE_DATA_CHARS:  # base64 of megabytes takes milliseconds: off the event loop
            return await asyncio.to_thread(data_url_bytes, url, param, policy.max_bytes)
        return data_url_bytes(url, param, policy.max_bytes)
    if scheme in ("http", "https"):
        return await fetch(url, param, policy)
    if scheme == "file":
        return await asyncio.to_thread(local_file_bytes, url, param, policy)
    raise APIError(400, f"The image URL {shown(url)!r} has no supported scheme; send a data: URL (base64), an "
                        "http(s):// URL, or file:// where the server allows it.", param=param, code="invalid_image_url")


def data_url_bytes(url: str, param: str, max_bytes: int) -> bytes:
    """data:[<media type>][;base64],<payload>: base64 only, an image media type (or none)."""
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise APIError(400, "The data: URL has no ',' before its payload.", param=param, code="invalid_image_url")
    fields = [f.strip().lower() for f in header.split(";")]
    media_type = fields[0]
    if "base64" not in fields[1:]:
        raise APIError(400, "A data: URL image must be base64 (data:image/png;base64,...).", param=param,
                       code="invalid_image_url")
    if media_type and not media_type.startswith("image/") and media_type not in _UNLABELLED:
        raise APIError(400, f"The data: URL's media type is {media_type!r}, not an image type.", param=param,
                       code="invalid_image_format")
    if len(payload) // 4 * 3 > max_bytes + 3:  # before decoding: base64 is 4 characters per 3 bytes
        raise too_large(param, max_bytes)
    try:
        # In slices: one b64decode call holds the GIL throughout, and megabytes of it would stall the event loop
        # even from a worker thread.
        data = b"".join(base64.b64decode(payload[at:at + _BASE64_SLICE_CHARS], validate=True)
                        for at in range(0, len(payload), _BASE64_SLICE_CHARS))
    except (binascii.Error, ValueError):
        raise APIError(400, "The data: URL's payload is not valid base64.", param=param,
                       code="invalid_image_url") from None
    if len(data) > max_bytes:
        raise too_large(param, max_bytes)
    return data


def too_large(param: str, max_bytes: int) -> APIError:
    return APIError(400, f"The image is larger than {max_bytes} bytes, the most the server takes for one image.",
                    param=param, code="image_too_large")


def local_file_bytes(url: str, param: str, policy: SourcePolicy) -> bytes:
    """file:// under --allowed-local-media-path, after symlinks are resolved (a link out of the directory is
    refused like any path out of it). Blocking: run it in a thread."""
    if policy.allowed_local_path is None:
        raise APIError(400, "file:// image URLs are not allowed on this server (it was started without "
                            "--allowed-local-media-path).", param=param, code="invalid_image_url")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise APIError(400, f"A file:// URL names no host; this one names {parts.netloc!r}.", param=param,
                       code="invalid_image_url")
    path = os.path.realpath(urllib.parse.unquote(parts.path))
    root = os.path.realpath(policy.allowed_local_path)
    if os.path.commonpath([path, root]) != root:
        raise APIError(400, f"The file {shown(url)!r} is outside the directory this server may read images from.",
                       param=param, code="invalid_image_url")
    if not os.path.isfile(path):  # checked before open(): opening a FIFO would block
        raise APIError(400, f"{shown(url)!r} is not a regular file.", param=param, code="invalid_image_url")
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # swapped for something else since the check
                raise APIError(400, f"{shown(url)!r} is not a regular file.", param=param, code="invalid_image_url")
            if os.fstat(f.fileno()).st_size > policy.max_bytes:
                raise too_large(param, policy.max_bytes)
            data = f.read(policy.max_bytes + 1)
    except OSError as error:
        raise APIError(400, f"Cannot read {shown(url)!r}: {error.strerror or error}.", param=param,
                       code="invalid_image_url") from None
    if len(data) > policy.max_bytes:  # a file that grew after fstat
        raise too_large(param, policy.max_bytes)
    return data


async def fetch(url: str, param: str, policy: SourcePolicy) -> bytes:
    """GET `url`, following at most max_redirects redirects (each hop's host checked), within
    fetch_timeout_s for the whole of it."""
    try:
        return await asyncio.wait_for(_follow(url, param, policy), policy.fetch_timeout_s)
    except asyncio.TimeoutError:  # (the builtin TimeoutError from 3.11 on)
        raise APIError(400, f"Fetching the image {shown(url)!r} took longer than {policy.fetch_timeout_s:g} s.",
                       param=param, code="image_fetch_timeout") from None


async def _follow(url: str, param: str, policy: SourcePolicy) -> bytes:
    for _ in range(policy.max_redirects + 1):
        status, location, data = await _get(url, param, policy)
        if status not in _REDIRECTS:
            return data
        if location is None:
            raise APIError(400, f"Fetching {shown(url)!r} answered a redirect ({status}) without a Location.",
                           param=param, code="image_fetch_failed")
        url = urllib.parse.urljoin(url, location)
    raise APIError(400, f"Fetching the image followed more than {policy.max_redirects} redirects.", param=param,
                   code="image_fetch_failed")


def _target(url: str, param: str, policy: SourcePolicy) -> tuple[str, int, bool, str]:
    """-> (host, port, tls, request target) of an http(s) URL the policy allows."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise APIError(400, f"A redirect led to {shown(url)!r}; only http(s) URLs are fetched.", param=param,
                       code="invalid_image_url")
    host = (parts.hostname or "").lower()
    if not host:
        raise APIError(400, f"The image URL {shown(url)!r} has no host.", param=param, code="invalid_image_url")
    if policy.allowed_domains and host not in policy.allowed_domains:
        raise APIError(400, f"The image host {host!r} is not among this server's --allowed-media-domains.",
                       param=param, code="invalid_image_url")
    tls = parts.scheme.lower() == "https"
    try:
        port = parts.port or (443 if tls else 80)
    except ValueError:
        raise APIError(400, f"The image URL {shown(url)!r} has an invalid port.", param=param,
                       code="invalid_image_url") from None
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return host, port, tls, target


async def _get(url: str, param: str, policy: SourcePolicy) -> tuple[int, str | None, bytes]:
    """One GET on its own connection -> (status, Location, body). A body is read only for a 200."""
    host, port, tls, target = _target(url, param, policy)
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_RESPONSE_HEADER_BYTES)
    authority = f"[{host}]" if ":" in host else host  # an IPv6 literal keeps its brackets in Host
    authority = authority if port == (443 if tls else 80) else f"{authority}:{port}"
    try:  # built before connecting: h11 refuses a target or host a request line cannot carry
        request = conn.send(h11.Request(method="GET", target=target, headers=[
            ("Host", authority), ("User-Agent", "rawserve"), ("Accept", "image/*"), ("Connection", "close")]))
        request += conn.send(h11.EndOfMessage())
    except h11.LocalProtocolError:
        raise APIError(400, f"The image URL {shown(url)!r} cannot be requested: it holds characters a request line "
                            "may not.", param=param, code="invalid_image_url") from None
    try:
        reader, writer = await asyncio.open_connection(host, port, ssl=ssl.create_default_context() if tls else None)
    except (OSError, ssl.SSLError) as error:
        raise APIError(400, f"Cannot connect to {host}:{port} to fetch the image: {error.strerror or error}.",
                       param=param, code="image_fetch_failed") from None
    try:
        writer.write(request)
        await writer.drain()
        return await _response(conn, reader, url, param, policy)
    except (OSError, ssl.SSLError) as error:  # reset or broken mid-exchange
        raise APIError(400, f"The image fetch failed: {error.strerror or error}.", param=param,
                       code="image_fetch_failed") from None
    finally:
        writer.close()


async def _response(conn: h11.Connection, reader: asyncio.StreamReader, url: str, param: str,
                    policy: SourcePolicy) -> tuple[int, str | None, bytes]:
    response = await _next_event(conn, reader, param)
    if not isinstance(response, h11.Response):
        raise APIError(400, "The image server closed the connection before answering.", param=param,
                       code="image_fetch_failed")
    headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in response.headers}
    if response.status_code in _REDIRECTS:
        return response.status_code, headers.get("location"), b""
    if response.status_code != 200:
        raise APIError(400, f"Fetching the image {shown(url)!r} answered HTTP {response.status_code}.",
                       param=param, code="image_fetch_failed")
    media_type = headers.get("content-type", "").split(";")[0].strip().lower()
    if not media_type.startswith("image/") and media_type not in _UNLABELLED:
        raise APIError(400, f"{shown(url)!r} is not an image: its content type is {media_type!r}.",
                       param=param, code="invalid_image_format")
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > policy.max_bytes:
        raise too_large(param, policy.max_bytes)
    body = bytearray()
    while True:
        event = await _next_event(conn, reader, param)
        if isinstance(event, h11.Data):
            body += event.data
            if len(body) > policy.max_bytes:
                raise too_large(param, policy.max_bytes)
        elif isinstance(event, h11.EndOfMessage):
            return 200, None, bytes(body)
        else:
            raise APIError(400, "The image server closed the connection mid-body.", param=param,
                           code="image_fetch_failed")


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader, param: str) -> object:
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as error:
            raise APIError(400, f"The image server's answer is not valid HTTP/1.1: {error}.", param=param,
                           code="image_fetch_failed") from None
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await reader.read(_READ_BYTES))  # b"" at EOF: h11 then reports the close
