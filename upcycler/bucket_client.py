"""The gs:// client settings, chosen once for everything in the process that talks to a bucket.

Three libraries reach buckets: gcsfs (our own reads and writes, `upcycler.io.object_store`), etils'
`epath` through fsspec (Orbax's directory operations, the trainer's run directory) and tensorstore's gcs
driver (Orbax's array data). `configure()` makes them all behave the same way:

- fsspec's `gs`/`gcs` protocols use `BucketFileSystem`, the plain `gcsfs.core.GCSFileSystem`, not the
  class `import gcsfs` selects by default, which first probes each bucket for a hierarchical namespace
  over gRPC and, where gRPC does not answer (an emulator, a proxy), waits about a minute per call;
- no listing cache: a listing is the bucket's state now (writers and readers are different processes on
  different hosts);
- `STORAGE_EMULATOR_HOST`, the standard variable of Google's clients, points gcsfs at an emulator with
  anonymous credentials, and tensorstore too (`TENSORSTORE_GCS_HTTP_URL`, unless set); otherwise
  Application Default Credentials are used, as `gcloud` does;
- every request of gcsfs follows one retry policy (`RetryPolicy`, below) instead of gcsfs's own (six
  tries over about 35 s, each logging a traceback to stderr, with a 120 s cap on a whole transfer): an
  endpoint that refuses, never answers or stops answering fails within the policy's deadline, as
  `StorageUnanswered`, a one-line error naming the endpoint and what to check; gcsfs's log stays quiet
  unless the application configures logging;
- tensorstore's requests follow the same policy as far as tensorstore can (`tensorstore_retries`: the
  same pauses, and only as many retries as fit in the deadline, instead of its default 32 retries with
  pauses up to 32 s, about 15 minutes of silence), in every context Orbax makes; a connection that
  carries nothing for the policy's `answer_wait` is dropped (curl's low-speed limit) and one that does
  not open within `connect_wait` is given up (`configure_tensorstore`, by the trainer's checkpoints).

What this module preserves: nothing outside gs:// changes; calling `configure()` again does nothing.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import functools
import gzip
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from upcycler.errors import UpcyclerError

T = TypeVar("T")
PUBLIC_ENDPOINT = "https://storage.googleapis.com"
ATTEMPTS_VARIABLE = "UPCYCLER_GCS_ATTEMPTS"
DEADLINE_VARIABLE = "UPCYCLER_GCS_DEADLINE"


@dataclass(frozen=True)
class RetryPolicy:
    """How one request to Cloud Storage is tried, and when it is given up.

    A request is tried at most `attempts` times. A failed try is retried when its failure is transient
    (no connection, no answer in time, a dropped connection, HTTP 408, 429 or 5xx: gcsfs's list), after
    a pause of `first_pause` seconds doubling up to `longest_pause` (each scaled by a random 0.5-1, so
    hosts retrying together spread out). `deadline` seconds after the first try began nothing waits
    any more: no try starts after it (nor a pause that would end past it), and a try waits at most
    `connect_wait` seconds for a connection and `answer_wait` seconds for each next piece of its answer,
    both cut to the time left. So an endpoint that refuses or never answers fails within `deadline`;
    an answer that keeps arriving (a large download) is never cut. (Name resolution is the system's,
    bounded by its resolver's own timeouts.)

    `UPCYCLER_GCS_ATTEMPTS` and `UPCYCLER_GCS_DEADLINE` (seconds) replace the defaults (`retry_policy`).
    """

    attempts: int = 6
    deadline: float = 20.0
    first_pause: float = 0.5
    longest_pause: float = 8.0
    connect_wait: float = 5.0
    answer_wait: float = 15.0

    def pause(self, tries: int) -> float:
        """The pause after the `tries`-th failed try (jittered)."""
        return self.longest_pause_after(tries) * random.uniform(0.5, 1.0)

    def longest_pause_after(self, tries: int) -> float:
        """The pause after the `tries`-th failed try before jitter: doubling from `first_pause`, capped."""
        return min(self.longest_pause, self.first_pause * 2 ** (tries - 1))

    def try_timeout(self, left: float) -> Any:
        """The waiting limits of one try that has `left` seconds before the deadline (an aiohttp
        `ClientTimeout`: no cap on a whole transfer, only on waiting)."""
        from aiohttp import ClientTimeout

        left = max(left, 0.001)
        return ClientTimeout(total=None, sock_connect=min(self.connect_wait, left),
                             sock_read=min(self.answer_wait, left))


def retry_policy() -> RetryPolicy:
    """The policy of this process: the defaults, or the ones `UPCYCLER_GCS_ATTEMPTS` and
    `UPCYCLER_GCS_DEADLINE` set (a bad value is refused in one line naming the variable)."""
    attempts = _setting(ATTEMPTS_VARIABLE, int, RetryPolicy.attempts, "a whole number of tries, at least 1")
    deadline = _setting(DEADLINE_VARIABLE, float, RetryPolicy.deadline, "a number of seconds above 0")
    return RetryPolicy(attempts=attempts, deadline=deadline)


def _setting(name: str, kind: type, default: Any, what: str) -> Any:
    """The positive number the environment variable `name` holds, or `default` when it is unset."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < float("inf"):
        raise UpcyclerError(f"{name}={text[:40]!r}: must be {what}; fix it or unset it "
                            f"(default {default})")
    return value


def endpoint() -> str:
    """Where gs:// requests go: the emulator of `STORAGE_EMULATOR_HOST`, else Cloud Storage itself."""
    return os.environ.get("STORAGE_EMULATOR_HOST") or PUBLIC_ENDPOINT


class StorageUnanswered(UpcyclerError):
    """Cloud Storage did not answer a request within the retry policy: refused, unreachable or silent."""

    def __init__(self, reason: str, tries: int, seconds: float):
        where = "STORAGE_EMULATOR_HOST" if os.environ.get("STORAGE_EMULATOR_HOST") else "the network or proxy"
        super().__init__(f"Cloud Storage at {endpoint()} does not answer ({reason}; {tries} "
                         f"{'try' if tries == 1 else 'tries'} in {seconds:.0f} s); check {where}, then retry "
                         f"({DEADLINE_VARIABLE} sets how long to wait)")


def unanswered_reason(err: BaseException) -> str | None:
    """Why `err` means the endpoint did not answer ("connection refused", …); None for any other failure
    (an HTTP error, a certificate the client refuses: the endpoint did answer)."""
    import aiohttp

    if isinstance(err, aiohttp.ClientSSLError):
        return None
    if isinstance(err, aiohttp.ClientConnectorDNSError):
        return "its host name does not resolve"
    if isinstance(err, aiohttp.ClientConnectorError):
        return "connection refused" if err.os_error.errno == errno.ECONNREFUSED else "no connection"
    if isinstance(err, aiohttp.ConnectionTimeoutError):
        return "no connection in time"
    if isinstance(err, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
        return "no answer in time"
    if isinstance(err, aiohttp.ClientConnectionError):
        return "the connection dropped without an answer"
    return None


def refusals() -> tuple[type[Exception], ...]:
    """What a gcsfs request raises when Cloud Storage refuses or fails it for good (once retried): gcsfs's
    `HttpError` (a status it does not map) and `OSError` (those it maps: a 403, a 404, …)."""
    from gcsfs.retry import HttpError

    return HttpError, OSError


def is_transient(err: BaseException) -> bool:
    """Whether a try that failed with `err` is worth another: gcsfs's transient errors, and timeouts."""
    from gcsfs.retry import is_retriable

    return is_retriable(err) or isinstance(err, asyncio.TimeoutError)


_TRY_TIMEOUT: ContextVar[Any] = ContextVar("upcycler_gcs_try_timeout", default=None)
"""The waiting limits of the try now running in this task (read by `BucketFileSystem.requests_timeout`)."""


_RETRYING: dict[int, tuple[float, int]] = {}
"""The requests of this process waiting to be tried again: (when their first try began, tries so far)."""


def storage_retrying() -> str | None:
    """What a progress line says while requests to Cloud Storage are being retried ("storage retrying:
    2 requests, 6 s": how many, and how long the oldest has been at it), None while none is."""
    waiting = list(_RETRYING.values())
    if not waiting:
        return None
    seconds = time.monotonic() - min(started for started, _ in waiting)
    return f"storage retrying: {len(waiting)} request{'s' if len(waiting) > 1 else ''}, {seconds:.0f} s"


async def retried(attempt: Callable[[], Awaitable[T]]) -> T:
    """The result of `attempt()`, tried as `retry_policy()` says; the last failure when it gives up
    (`StorageUnanswered` when the endpoint did not answer). While it waits to try again it is counted by
    `storage_retrying`."""
    policy, started = retry_policy(), time.monotonic()
    tries, me = 0, object()
    try:
        while True:
            tries += 1
            token = _TRY_TIMEOUT.set(policy.try_timeout(policy.deadline - (time.monotonic() - started)))
            try:
                return await attempt()
            except Exception as err:
                pause, spent = policy.pause(tries), time.monotonic() - started
                if not is_transient(err):
                    raise
                if tries >= policy.attempts or spent + pause >= policy.deadline:
                    reason = unanswered_reason(err)
                    if reason is None:
                        raise
                    raise StorageUnanswered(reason, tries, spent) from err
            finally:
                _TRY_TIMEOUT.reset(token)
            _RETRYING[id(me)] = (started, tries)
            await asyncio.sleep(pause)
    finally:
        _RETRYING.pop(id(me), None)


WHOLE_READS = 2  # a whole object whose bytes do not match its CRC32C is read once more, then refused


class DamagedRead(UpcyclerError):
    """An object whose bytes never matched the CRC32C Cloud Storage holds for it, read `WHOLE_READS` times."""


async def checked_whole_read(key: str, get: Callable[[], Awaitable[tuple[Any, bytes]]]) -> bytes:
    """The bytes of the object `key` (`bucket/key`) that `get()` answers (its headers, its body as stored).
    When they are the whole object (no range, or one from byte 0 to its end), they are kept only once they
    match the CRC32C the answer's `x-goog-hash` holds for the object, read again once when they do not, and
    refused after that (`DamagedRead`, one line naming the object). A part of an object cannot be checked
    against the object's checksum (the token blocks of a prepared source carry their own). An object stored
    gzip-compressed arrives compressed, is checked so, and is returned decompressed."""
    import google_crc32c

    seen = []
    for _ in range(WHOLE_READS):
        headers, body = await get()
        expected = _whole_object_crc32c(headers, len(body))
        got = google_crc32c.value(body).to_bytes(4, "big")
        if expected is None or got == expected:
            return gzip.decompress(body) if headers.get("content-encoding", "") == "gzip" else body
        seen.append(base64.b64encode(got).decode())
    raise DamagedRead(f"gs://{key}: read {WHOLE_READS} times, its bytes never matched the CRC32C the bucket holds "
                      f"for it ({base64.b64encode(expected).decode()}; read {', '.join(seen)}): corrupted on the way "
                      "(check the network or proxy, then rerun) or in the bucket (write it again)")


def _whole_object_crc32c(headers: Any, size: int) -> bytes | None:
    """The object's CRC32C (4 big-endian bytes) from an answer's `x-goog-hash`, when the answer's `size`
    bytes are the whole object as stored; else None."""
    stored = headers.get("x-goog-stored-content-encoding", "identity")
    if stored != "identity" and headers.get("content-encoding", "identity") != stored:
        return None  # decompressed by the bucket on the way: not the bytes the checksum is of
    ranged = headers.get("content-range")
    if ranged is not None and ranged.strip() != f"bytes 0-{size - 1}/{size}":
        return None
    found = [part.split("=", 1)[1] for part in headers.get("x-goog-hash", "").split(",") if part.startswith("crc32c=")]
    return base64.b64decode(found[0]) if found else None


def tensorstore_retries(policy: RetryPolicy) -> dict[str, Any]:
    """tensorstore's `gcs_request_retries` resource for `policy`. tensorstore has no deadline, so its
    retries are bounded instead: the policy's pauses (tensorstore adds up to `min(1 s, first pause)` of
    jitter to each, counted here), and as many retries as fit, together, in the deadline (at most
    `attempts - 1`). With the defaults: 5 retries, pauses 0.5 s to 8 s, under 18 s of waiting in all."""
    jitter = min(1.0, policy.first_pause)
    retries, waited = 0, 0.0
    while retries < policy.attempts - 1:
        pause = min(policy.longest_pause, policy.longest_pause_after(retries + 1) + jitter)
        if waited + pause > policy.deadline:
            break
        retries, waited = retries + 1, waited + pause
    return {"max_retries": retries, "initial_delay": f"{policy.first_pause}s", "max_delay": f"{policy.longest_pause}s"}


def tensorstore_context() -> dict[str, Any]:
    """The tensorstore context resources every context that may reach a bucket gets (`tensorstore_retries`
    of this process's policy)."""
    return {"gcs_request_retries": tensorstore_retries(retry_policy())}


@functools.cache
def configure_tensorstore() -> None:
    """`configure()`, and tensorstore's gcs driver on the retry policy: the retries in Orbax's default
    contexts (every context Orbax makes copies them), curl's waits in its environment (read when
    tensorstore first opens a connection; a value already set is kept). Called by what hands Orbax a
    location that may be a bucket, before it does (importing Orbax costs a second: `configure` does not)."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    configure()
    policy = retry_policy()
    for defaults in (tensorstore_utils._BASE_TS_CONTEXT, tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT):
        defaults.update(tensorstore_context())
    os.environ.setdefault("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", str(max(1, round(policy.connect_wait))))
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", str(max(1, round(policy.answer_wait))))
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")


@functools.cache
def bucket_filesystem_class() -> type:
    """`BucketFileSystem`: gcsfs's plain client with the defaults of the module docstring."""
    from gcsfs.core import GCSFileSystem
    from gcsfs.utils import is_empty_range

    plain_request = GCSFileSystem._request.__wrapped__  # gcsfs's requests without gcsfs's retries
    plain_get_file_request = GCSFileSystem._get_file_request.__wrapped__

    class BucketFileSystem(GCSFileSystem):
        def __init__(self, *args: Any, **kwargs: Any):
            emulator = os.environ.get("STORAGE_EMULATOR_HOST")
            if emulator:
                kwargs.setdefault("token", "anon")
                kwargs.setdefault("endpoint_url", emulator)
            kwargs.setdefault("use_listings_cache", False)
            super().__init__(*args, **kwargs)

        @property
        def requests_timeout(self) -> Any:
            """The waiting limits of the current try (`RetryPolicy.try_timeout`): gcsfs reads this for
            every request."""
            current, policy = _TRY_TIMEOUT.get(), retry_policy()
            return current if current is not None else policy.try_timeout(policy.deadline)

        @requests_timeout.setter
        def requests_timeout(self, value: Any) -> None:
            """Ignored: the retry policy sets the waits."""

        async def _request(self, *args: Any, **kwargs: Any) -> Any:
            return await retried(lambda: plain_request(self, *args, **kwargs))

        async def _get_file_request(self, *args: Any, **kwargs: Any) -> Any:
            return await retried(lambda: plain_get_file_request(self, *args, **kwargs))

        # One orchestration of a concurrent download, not retried as a whole: its requests each are.
        _get_file_concurrent = GCSFileSystem._get_file_concurrent.__wrapped__

        async def _cat_file_sequential(self, path: str, start: int | None = None, end: int | None = None,
                                       **kwargs: Any) -> bytes:
            """gcsfs's one-request read, with a read of a whole object checked (`checked_whole_read`)."""
            if is_empty_range(start, end):
                return b""
            url = self.url(path, generation=kwargs.get("generation"))
            limits = {} if start is None and end is None else {"Range": await self._process_limits(path, start, end)}
            return await checked_whole_read(path, lambda: retried(lambda: self._get_as_stored(url, limits)))

        async def _get_as_stored(self, url: str, headers: dict[str, str]) -> tuple[Any, bytes]:
            """One GET of `url`: the answer's headers and its body as the bucket stores it (a gzip-stored
            object's compressed bytes, not decompressed on the way)."""
            from gcsfs.retry import validate_response

            await self._set_session()
            async with self.session.get(url, params=self._get_params({}), headers=self._get_headers(dict(headers)),
                                        auto_decompress=False, timeout=self.requests_timeout) as answer:
                body = await answer.read()
                validate_response(answer.status, body, url)
                return answer.headers, body

    return BucketFileSystem


@functools.cache
def configure() -> None:
    """Register `BucketFileSystem` for fsspec's gs:// and point tensorstore at the emulator, if any;
    check the retry policy's variables; keep gcsfs's log off stderr unless logging is configured."""
    import fsspec

    retry_policy()
    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, bucket_filesystem_class(), clobber=True)
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator:
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", emulator)
    logging.getLogger("gcsfs").addHandler(logging.NullHandler())
