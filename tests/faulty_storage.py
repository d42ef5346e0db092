"""Storage that misbehaves, for the tests: a loopback HTTP proxy in front of the run's storage emulator that
passes every request through and damages the answers a test chooses, deterministically.

`FaultyStorage(upstream)` listens on a free port of 127.0.0.1 (nothing else); a test points
`STORAGE_EMULATOR_HOST` at its `url` and says what goes wrong:

- `flip_bit(object, times)`: the next `times` downloads of `bucket/key` (whole or ranged reads, `alt=media`)
  arrive with one bit flipped, at a position drawn from a seeded generator (the same run flips the same
  bits); `times=None` corrupts every download. Metadata (sizes, generations, checksums) is passed as it is,
  as when bytes are damaged on the way;
- `refuse_writes(prefix, status)`: every request that would change an object whose name (`bucket/key`)
  starts with `prefix` (an upload, a compose or copy into it, a deletion) is answered `status` (503, a
  "transient" error every client retries, by default) with Cloud Storage's JSON error body, for good.

Each fault counts the answers it damaged or refused (`damaged`). Every other request and answer is passed through as it
is (an upload's `Location` made to point at the proxy, so a resumable upload stays behind it).
"""

from __future__ import annotations

import asyncio
import random
import re
import threading
from dataclasses import dataclass
from urllib.parse import unquote

from aiohttp import ClientSession, web

_OBJECT_PATH = re.compile(r"/b/([^/]+)/o(?:/([^/?]+))?")  # a key's slashes are escaped (%2F) in a URL
_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


@dataclass
class BitFlip:
    """Flip one bit of the next `times` downloads of `name` (`bucket/key`); every one when `times` is None."""

    name: str
    times: int | None
    damaged: int = 0

    def wants(self, name: str) -> bool:
        return name == self.name and (self.times is None or self.damaged < self.times)


@dataclass
class RefusedWrites:
    """Answer `status` to every change of an object whose `bucket/key` starts with `prefix`."""

    prefix: str
    status: int
    damaged: int = 0


class FaultyStorage:
    """The proxy of the module docstring, serving on its own thread until `stop`."""

    def __init__(self, upstream: str, seed: int = 0):
        self.upstream = upstream.rstrip("/")
        self.faults: list[BitFlip | RefusedWrites] = []
        self._random = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the faulty storage proxy did not start within 30 s")

    def flip_bit(self, name: str, times: int | None = 1) -> BitFlip:
        """Damage the next `times` downloads of the object `name` (`bucket/key`); see the module docstring."""
        fault = BitFlip(name, times)
        self.faults.append(fault)
        return fault

    def refuse_writes(self, prefix: str, status: int = 503) -> RefusedWrites:
        """Refuse, for good, every change under `prefix` (`bucket/key…`); see the module docstring."""
        fault = RefusedWrites(prefix, status)
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

    async def _forward(self, request: web.Request) -> web.Response:
        """Pass `request` to the emulator and its answer back, damaged as the faults say."""
        refusal = self._refusal(request)
        if refusal is not None:
            refusal.damaged += 1
            error = {"error": {"code": refusal.status, "message": "refused by the faulty storage of the tests"}}
            return web.json_response(error, status=refusal.status)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        async with self._session.request(request.method, self.upstream + request.raw_path, headers=headers,
                                         data=await request.read(), allow_redirects=False) as answer:
            body = await answer.read()
            status, answer_headers = answer.status, [(k, v) for k, v in answer.headers.items()
                                                     if k.lower() not in _HOP_HEADERS]
        if status in (200, 206) and request.method == "GET" and request.query.get("alt") == "media":
            body = self._damaged(_object_name(request.raw_path), body)
        answer_headers = [(k, v.replace(self.upstream, self.url) if k.lower() == "location" else v)
                          for k, v in answer_headers]
        return web.Response(status=status, headers=answer_headers, body=body)

    def _refusal(self, request: web.Request) -> RefusedWrites | None:
        """The fault that refuses `request`, a change of an object (by its path, else its `name=`)."""
        if request.method in ("GET", "HEAD"):
            return None
        name = _object_name(request.raw_path)
        if name is not None and name.endswith("/") and "name" in request.query:  # an upload: `…/o?name=KEY`
            name += request.query["name"]
        return next((f for f in self.faults if isinstance(f, RefusedWrites) and name
                     and name.startswith(f.prefix)), None)

    def _damaged(self, name: str | None, body: bytes) -> bytes:
        """`body` with one bit flipped when a fault wants the object `name`, else as it is."""
        fault = next((f for f in self.faults if isinstance(f, BitFlip) and name and body and f.wants(name)), None)
        if fault is None:
            return body
        fault.damaged += 1
        bit = self._random.randrange(len(body) * 8)
        damaged = bytearray(body)
        damaged[bit // 8] ^= 1 << (bit % 8)
        return bytes(damaged)


def _object_name(raw_path: str) -> str | None:
    """`bucket/key` of a JSON API object URL (`…/b/BUCKET/o/KEY…`; the last one named, the target of a copy),
    `bucket/` for the bucket's objects (`…/b/BUCKET/o`: listings, uploads), None for any other URL."""
    found = list(_OBJECT_PATH.finditer(raw_path.split("?", 1)[0]))
    if not found:
        return None
    bucket, key = found[-1].groups()
    return f"{unquote(bucket)}/{unquote(key or '')}"
