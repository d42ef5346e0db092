"""Storage that misbehaves, for the tests: a loopback HTTP proxy in front of the run's storage emulator that
passes every request through and damages the answers a test chooses, deterministically.

`FaultyStorage(upstream)` listens on a free port of 127.0.0.1 (nothing else); a test points
`STORAGE_EMULATOR_HOST` at its `url` and says what goes wrong:

- `flip_bit(object, times, from_byte)`: the next `times` downloads of `bucket/key` (whole or ranged reads,
  `alt=media`; only those starting at `from_byte` or later) arrive with one bit flipped, at a position drawn
  from a seeded generator (the same run flips the same bits); `times=None` corrupts every download. Metadata (sizes, generations, checksums) is passed as it is,
  as when bytes are damaged on the way;
- `flip_upload_bit(object, times)`: the next `times` single-request uploads of `bucket/key` (a multipart
  upload: metadata, then the bytes) reach the emulator with one bit of their bytes flipped;
- `refuse_writes(prefix, status)`: every request that would change an object whose name (`bucket/key`)
  starts with `prefix` (an upload, a compose or copy into it, a deletion) is answered `status` (503, a
  "transient" error every client retries, by default) with Cloud Storage's JSON error body, for good;
- `transient(rate, kinds)`: each request, with probability `rate` (the seeded generator's draw), meets one
  of the faults a client must retry through (`TRANSIENT_KINDS`): a 503 or a 429 instead of an answer
  (nothing done), the connection reset before it is passed on (nothing done), the answer lost after the
  emulator carried the request out (the change done, the client told nothing), the answer held back for
  `DELAY` seconds, or a download's body cut short after its headers promised all of it;
- `list_also(name, like)`: a bucket that holds an object the emulator cannot (`bucket/a/../b`: its
  filesystem backend would store it outside its root): every listing whose prefix `name` falls under lists
  it too, with the metadata of the stored object `like`, and a read of `name` (its metadata or its bytes)
  is answered as one of `like`.

Each fault counts the answers it damaged or refused (`damaged`; a transient one by kind in `kinds_met`).
Every other request and answer is passed through as it is (an upload's `Location` made to point at the
proxy, so a resumable upload stays behind it), but for two gaps of the emulator, where the proxy answers as
Cloud Storage does: a resumable upload that completed and is sent again (its answer was lost) is answered
with the object again (`200`), where the emulator answers 404; and a chunk of a resumable upload sent again
after the emulator kept it is answered with what is kept (`308`, its `Range`), where the emulator would
append it a second time.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import quote, unquote

from aiohttp import ClientSession, web

_OBJECT_PATH = re.compile(r"/b/([^/]+)/o(?:/([^/?]+))?")  # a key's slashes are escaped (%2F) in a URL
_METADATA_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')  # an object's name in an upload's JSON metadata
_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass
class BitFlip:
    """Flip one bit of the next `times` downloads of `name` (`bucket/key`) that start at byte `from_byte` or
    later; every one when `times` is None."""

    name: str
    times: int | None
    from_byte: int = 0
    damaged: int = 0

    def wants(self, name: str, start: int) -> bool:
        return (name == self.name and start >= self.from_byte
                and (self.times is None or self.damaged < self.times))


@dataclass
class UploadFlip:
    """Flip one bit of the bytes of the next `times` multipart uploads of `name` (`bucket/key`)."""

    name: str
    times: int
    damaged: int = 0


@dataclass
class RefusedWrites:
    """Answer `status` to every change of an object whose `bucket/key` starts with `prefix`."""

    prefix: str
    status: int
    damaged: int = 0


@dataclass
class ListedAlso:
    """List `name` (`bucket/key`) beside the emulator's objects, as a copy of the stored object `like`."""

    name: str
    like: str
    damaged: int = 0


TRANSIENT_KINDS = ("503", "429", "reset", "lost", "delay", "truncate")
DELAY = 2.0  # seconds a "delay" holds an answer back (under the retry policy's wait for an answer)


@dataclass
class Transient:
    """Meet each request with one of `kinds` (`TRANSIENT_KINDS`) with probability `rate`."""

    rate: float
    kinds: tuple[str, ...] = TRANSIENT_KINDS
    damaged: int = 0
    kinds_met: Counter = field(default_factory=Counter)


class FaultyStorage:
    """The proxy of the module docstring, serving on its own thread until `stop`."""

    def __init__(self, upstream: str, seed: int = 0):
        self.upstream = upstream.rstrip("/")
        self.faults: list[BitFlip | UploadFlip | RefusedWrites | Transient | ListedAlso] = []
        self._random = random.Random(seed)
        self._finished_uploads: dict[str, tuple[int, list, bytes]] = {}  # upload_id -> its final answer
        self._persisted: dict[str, int] = {}  # upload_id -> bytes the emulator holds of it
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the faulty storage proxy did not start within 30 s")

    def flip_bit(self, name: str, times: int | None = 1, from_byte: int = 0) -> BitFlip:
        """Damage the next `times` downloads of the object `name` (`bucket/key`) that start at `from_byte` or
        later (a ranged read's first byte); see the module docstring."""
        fault = BitFlip(name, times, from_byte)
        self.faults.append(fault)
        return fault

    def flip_upload_bit(self, name: str, times: int = 1) -> UploadFlip:
        """Damage the bytes of the next `times` multipart uploads of `name`; see the module docstring."""
        fault = UploadFlip(name, times)
        self.faults.append(fault)
        return fault

    def refuse_writes(self, prefix: str, status: int = 503) -> RefusedWrites:
        """Refuse, for good, every change under `prefix` (`bucket/key…`); see the module docstring."""
        fault = RefusedWrites(prefix, status)
        self.faults.append(fault)
        return fault

    def transient(self, rate: float, kinds: tuple[str, ...] = TRANSIENT_KINDS) -> Transient:
        """Meet a share `rate` of all requests with a transient fault; see the module docstring."""
        fault = Transient(rate, tuple(kinds))
        self.faults.append(fault)
        return fault

    def list_also(self, name: str, like: str) -> ListedAlso:
        """List the object `name` (`bucket/key`) as a copy of `like`; see the module docstring."""
        fault = ListedAlso(name, like)
        self.faults.append(fault)
        return fault

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _start(self) -> None:
        self._session = ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 40)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        app.on_cleanup.append(lambda _: self._session.close())
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        """Pass `request` to the emulator and its answer back, damaged as the faults say."""
        refusal = await self._refusal(request)
        if refusal is not None:
            refusal.damaged += 1
            return _error(refusal.status)
        kind = self._transient_kind()
        if kind in ("503", "429"):
            return _error(int(kind))
        if kind == "reset":
            return _drop(request)
        listed = next((f for f in self.faults if isinstance(f, ListedAlso)
                       and _object_name(request.raw_path) == f.name and request.method == "GET"), None)
        status, answer_headers, body = await self._answer(request, listed and _renamed(request, listed))
        if listed is not None and request.query.get("alt") != "media":
            body = body.replace(json.dumps(listed.like.split("/", 1)[1]).encode(),
                                json.dumps(listed.name.split("/", 1)[1]).encode())
        elif status == 200 and request.method == "GET" and _object_name(request.raw_path, listing=True):
            body = await self._listed_also(request, body)
        if kind == "lost":
            return _drop(request)
        if kind == "delay":
            await asyncio.sleep(DELAY)
        if status in (200, 206) and request.method == "GET" and request.query.get("alt") == "media":
            body = self._damaged(_object_name(request.raw_path), _range_start(request), body)
            if kind == "truncate" and len(body) > 1:
                return await _cut_short(request, status, answer_headers, body)
        return web.Response(status=status, headers=answer_headers, body=body)

    async def _answer(self, request: web.Request, raw_path: str | None = None) -> tuple[int, list, bytes]:
        """The emulator's answer to `request` (a `Location` pointing at the proxy), or Cloud Storage's own
        where the emulator's differs (a completed resumable upload sent again); `raw_path` in place of the
        request's path when given."""
        upload = request.query.get("upload_id") if request.method in ("PUT", "POST") else None
        if upload in self._finished_uploads:
            return self._finished_uploads[upload]
        chunk_end = _chunk_end(request.headers.get("Content-Range", ""))
        if upload and chunk_end is not None and chunk_end < self._persisted.get(upload, 0):
            return 308, [("Range", f"bytes=0-{self._persisted[upload] - 1}")], b""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        async with self._session.request(request.method, self.upstream + (raw_path or request.raw_path),
                                         headers=headers,
                                         data=self._sent(request, await request.read()),
                                         allow_redirects=False) as answer:
            body = await answer.read()
            status = answer.status
            answer_headers = [(k, v.replace(self.upstream, self.url) if k.lower() == "location" else v)
                              for k, v in answer.headers.items() if k.lower() not in _HOP_HEADERS]
        if upload and status in (200, 201):
            self._finished_uploads[upload] = (status, answer_headers, body)
        if upload and status == 308 and chunk_end is not None:
            self._persisted[upload] = chunk_end + 1
        return status, answer_headers, body

    def _sent(self, request: web.Request, body: bytes) -> bytes:
        """The body passed on: a multipart upload's bytes with one bit flipped when a fault wants them."""
        if request.method != "POST" or request.query.get("uploadType") != "multipart":
            return body
        found = _METADATA_NAME.search(body[:65536].decode("latin-1"))
        name = f"{_object_name(request.raw_path)}{found[1] if found else ''}"
        fault = next((f for f in self.faults if isinstance(f, UploadFlip) and f.name == name
                      and f.damaged < f.times), None)
        start = body.find(b"\n\n", body.find(b"Content-Type", body.find(b"}"))) + 2  # the bytes' part
        stop = body.rfind(b"\n--")
        if fault is None or not 0 < start < stop:
            return body
        fault.damaged += 1
        bit = self._random.randrange(start * 8, stop * 8)
        damaged = bytearray(body)
        damaged[bit // 8] ^= 1 << (bit % 8)
        return bytes(damaged)

    def _transient_kind(self) -> str | None:
        """The transient fault this request meets, if any (one draw per transient fault, in order)."""
        for fault in (f for f in self.faults if isinstance(f, Transient)):
            if self._random.random() < fault.rate:
                kind = self._random.choice(fault.kinds)
                fault.damaged += 1
                fault.kinds_met[kind] += 1
                return kind
        return None

    async def _refusal(self, request: web.Request) -> RefusedWrites | None:
        """The fault that refuses `request`, a change of an object (named by its path, its `name=`, or the
        metadata part of a multipart upload's body)."""
        if request.method in ("GET", "HEAD"):
            return None
        name = _object_name(request.raw_path)
        if name is not None and name.endswith("/"):  # an upload: `…/o?name=KEY`, or the name in its body
            found = _METADATA_NAME.search((await request.read())[:65536].decode("latin-1"))
            name += request.query.get("name") or (found[1] if found else "")
        return next((f for f in self.faults if isinstance(f, RefusedWrites) and name
                     and name.startswith(f.prefix)), None)

    def _damaged(self, name: str | None, start: int, body: bytes) -> bytes:
        """`body` (the object's bytes from `start`) with one bit flipped when a fault wants it, else as it is."""
        fault = next((f for f in self.faults if isinstance(f, BitFlip) and name and body and f.wants(name, start)),
                     None)
        if fault is None:
            return body
        fault.damaged += 1
        bit = self._random.randrange(len(body) * 8)
        damaged = bytearray(body)
        damaged[bit // 8] ^= 1 << (bit % 8)
        return bytes(damaged)


    async def _listed_also(self, request: web.Request, body: bytes) -> bytes:
        """A listing's last page (`body`) with each `ListedAlso` object its prefix covers added."""
        page = json.loads(body)
        bucket, prefix = _object_name(request.raw_path, listing=True)[:-1], request.query.get("prefix", "")
        delimiter = request.query.get("delimiter", "")
        for fault in (f for f in self.faults if isinstance(f, ListedAlso) and not page.get("nextPageToken")):
            fault_bucket, _, key = fault.name.partition("/")
            if fault_bucket != bucket or not key.startswith(prefix):
                continue
            fault.damaged += 1
            rest = key[len(prefix):]
            if delimiter and delimiter in rest:
                page.setdefault("prefixes", []).append(prefix + rest.split(delimiter, 1)[0] + delimiter)
                continue
            like = quote(fault.like.split("/", 1)[1], safe="")
            async with self._session.get(f"{self.upstream}/storage/v1/b/{bucket}/o/{like}") as answer:
                item = json.loads(await answer.read())
            page.setdefault("items", []).append(item | {"name": key, "id": f"{fault.name}/{item.get('generation')}"})
        return json.dumps(page).encode()


def _renamed(request: web.Request, listed: ListedAlso) -> str:
    """The path of `request` (a read of `listed.name`) made a read of `listed.like`."""
    path, sep, query = request.raw_path.partition("?")
    head = path[: path.rindex("/o/") + 3]
    return f"{head}{quote(listed.like.split('/', 1)[1], safe='')}{sep}{query}"


def _object_name(raw_path: str, listing: bool = False) -> str | None:
    """`bucket/key` of a JSON API object URL (`…/b/BUCKET/o/KEY…`; the last one named, the target of a copy),
    `bucket/` for the bucket's objects (`…/b/BUCKET/o`: listings, uploads), None for any other URL; with
    `listing`, only `bucket/` of a listing (None for anything else)."""
    found = list(_OBJECT_PATH.finditer(raw_path.split("?", 1)[0]))
    if not found or (listing and ("/upload/" in raw_path or found[-1].group(2) is not None)):
        return None
    bucket, key = found[-1].groups()
    return f"{unquote(bucket)}/{unquote(key or '')}"


def _range_start(request: web.Request) -> int:
    """The first byte a download asks for (`Range: bytes=A-…`), 0 for the whole object."""
    found = re.match(r"bytes=(\d+)-", request.headers.get("Range", ""))
    return int(found[1]) if found else 0


def _chunk_end(content_range: str) -> int | None:
    """The last byte a resumable upload's chunk carries (`Content-Range: bytes A-B/T`), None without one."""
    found = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", content_range.strip())
    return int(found[2]) if found else None


def _error(status: int) -> web.Response:
    """Cloud Storage's JSON error answer with `status`."""
    error = {"error": {"code": status, "message": "refused by the faulty storage of the tests"}}
    return web.json_response(error, status=status)


def _drop(request: web.Request) -> web.Response:
    """Close the connection of `request` without an answer (the response returned is never sent)."""
    request.transport.close()
    return web.Response(status=500)


async def _cut_short(request: web.Request, status: int, headers: list, body: bytes) -> web.StreamResponse:
    """Send the headers of an answer promising all of `body`, then half of it, then close the connection."""
    answer = web.StreamResponse(status=status, headers=headers)
    answer.content_length = len(body)
    await answer.prepare(request)
    await answer.write(body[: len(body) // 2])
    request.transport.close()
    return answer
