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
  Application Default Credentials are used, as `gcloud` does.

What this module preserves: nothing outside gs:// changes; calling `configure()` again does nothing.
"""

from __future__ import annotations

import functools
import os
from typing import Any


@functools.cache
def bucket_filesystem_class() -> type:
    """`BucketFileSystem`: gcsfs's plain client with the defaults of the module docstring."""
    from gcsfs.core import GCSFileSystem

    class BucketFileSystem(GCSFileSystem):
        def __init__(self, *args: Any, **kwargs: Any):
            emulator = os.environ.get("STORAGE_EMULATOR_HOST")
            if emulator:
                kwargs.setdefault("token", "anon")
                kwargs.setdefault("endpoint_url", emulator)
            kwargs.setdefault("use_listings_cache", False)
            kwargs.setdefault("retries", 3)
            kwargs.setdefault("requests_timeout", 120)
            super().__init__(*args, **kwargs)

    return BucketFileSystem


@functools.cache
def configure() -> None:
    """Register `BucketFileSystem` for fsspec's gs:// and point tensorstore at the emulator, if any."""
    import fsspec

    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, bucket_filesystem_class(), clobber=True)
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator:
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", emulator)
