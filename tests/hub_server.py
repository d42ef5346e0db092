"""An in-memory Hugging Face Hub for tests: the HTTP routes `huggingface_hub` uses without Xet.

It serves create-repo, branch creation, YAML validation, preupload, the LFS batch API with basic PUT
upload and verify, the NDJSON commit, tree listing, repo info, refs and resolve (HEAD/GET) downloads.
Clients must run with Xet disabled (`HF_HUB_DISABLE_XET=1` or the constant patched) and be given the
endpoint explicitly. Knobs for tests:

- `fail(route, status, times)` makes the next `times` requests to a route (all of them when `times` is
  None, until `clear_failures()`) answer `status`; routes are the names in `ROUTES`.
- `require_token(token)` answers 401 to any request without `Authorization: Bearer <token>` (except
  the LFS PUT, which goes to a pre-signed URL on the real Hub).
- `requests` records every request as `(method, route, path)`; unknown routes as route "unknown".

    with FakeHub() as hub:
        HfApi(endpoint=hub.url, token="t").create_repo("me/model")
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import unquote, urlsplit

import yaml

REPO = r"(?P<repo>[^/]+/[^/]+)"
REV = r"(?P<rev>[^/]+)"
ROUTES: list[tuple[str, str, re.Pattern[str]]] = [
    (m, name, re.compile(pattern))
    for m, name, pattern in [
        ("POST", "create", r"/api/repos/create"),
        ("POST", "validate-yaml", r"/api/validate-yaml"),
        ("POST", "preupload", rf"/api/models/{REPO}/preupload/{REV}"),
        ("POST", "commit", rf"/api/models/{REPO}/commit/{REV}"),
        ("POST", "branch", rf"/api/models/{REPO}/branch/{REV}"),
        ("GET", "tree", rf"/api/models/{REPO}/tree/{REV}(?:/(?P<path>.*))?"),
        ("GET", "refs", rf"/api/models/{REPO}/refs"),
        ("GET", "info", rf"/api/models/{REPO}(?:/revision/{REV})?"),
        ("POST", "lfs-batch", rf"/{REPO}\.git/info/lfs/objects/batch"),
        ("PUT", "lfs-upload", r"/lfs-objects/(?P<oid>[0-9a-f]{64})"),
        ("POST", "lfs-verify", r"/lfs-objects/(?P<oid>[0-9a-f]{64})/verify"),
        ("GET", "resolve", rf"/{REPO}/resolve/{REV}/(?P<path>.+)"),
        ("HEAD", "resolve", rf"/{REPO}/resolve/{REV}/(?P<path>.+)"),
    ]
]
Response = tuple[int, dict[str, str], bytes]  # status, headers, body
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".npz")
LFS_MIN_BYTES = 10 * 1024 * 1024


@dataclass
class Repo:
    """A repo: branch name → commit id, and commit id → {path: (bytes, stored as LFS)}."""

    private: bool
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, dict[str, tuple[bytes, bool]]] = field(default_factory=dict)


class HubError(Exception):
    """An HTTP error answer: status, JSON error message and optional `X-Error-Code`."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class FakeHub:
    """The server and its state; use as a context manager (or `start()` / `stop()`)."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.requests: list[tuple[str, str, str]] = []
        self.token: str | None = None
        self._failures: dict[str, list[Any]] = {}
        self._lock = threading.Lock()
        self._commit_count = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    # --- lifecycle and knobs ---------------------------------------------------------------------------
    def start(self) -> FakeHub:
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def fail(self, route: str, status: int = 500, times: int | None = None) -> None:
        self._failures[route] = [status, times]

    def clear_failures(self) -> None:
        self._failures.clear()

    def require_token(self, token: str | None) -> None:
        self.token = token

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """The content of every file at `revision`."""
        repo = self.repos[repo_id]
        return {path: data for path, (data, _) in repo.commits[repo.branches[revision]].items()}

    # --- dispatch ------------------------------------------------------------------------------------
    def handle(self, method: str, raw_path: str, headers: Any, body: bytes) -> Response:
        path = urlsplit(raw_path).path
        found = next(((r, m) for verb, r, p in ROUTES if verb == method and (m := p.fullmatch(path))), None)
        with self._lock:
            self.requests.append((method, found[0] if found else "unknown", path))
            if found is None:
                return _json(404, {"error": f"no route for {method} {path}"})
            route, match = found
            args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
            try:
                self._check(route, headers)
                return getattr(self, "_on_" + route.replace("-", "_"))(body=body, method=method, **args)
            except HubError as err:
                extra = {"X-Error-Code": err.code} if err.code else {}
                if err.status == 401:
                    extra["X-Error-Message"] = "Invalid credentials in Authorization header"
                status, head, payload = _json(err.status, {"error": err.message})
                return status, {**head, **extra}, payload

    def _check(self, route: str, headers: Any) -> None:
        failure = self._failures.get(route)
        if failure:
            status, times = failure
            if times is not None:
                failure[1] -= 1
                if failure[1] <= 0:
                    del self._failures[route]
            raise HubError(status, f"injected failure on {route}")
        if self.token and route != "lfs-upload" and headers.get("Authorization") != f"Bearer {self.token}":
            raise HubError(401, "Invalid credentials in Authorization header")

    def _repo(self, repo_id: str) -> Repo:
        if repo_id not in self.repos:
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return self.repos[repo_id]

    def _files_at(self, repo_id: str, rev: str) -> dict[str, tuple[bytes, bool]]:
        repo = self._repo(repo_id)
        commit = repo.branches.get(rev, rev)
        if commit not in repo.commits:
            raise HubError(404, f"Revision {rev} not found", "RevisionNotFound")
        return repo.commits[commit]

    def _new_commit(self, repo: Repo, files: dict[str, tuple[bytes, bool]]) -> str:
        self._commit_count += 1
        oid = hashlib.sha1(f"commit {self._commit_count}".encode()).hexdigest()
        repo.commits[oid] = files
        return oid

    # --- routes --------------------------------------------------------------------------------------
    def _on_create(self, body: bytes, **_: Any) -> Response:
        req = json.loads(body)
        repo_id = f"{req.get('organization') or 'user'}/{req['name']}"
        if repo_id in self.repos:
            return _json(
                409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
            )
        repo = Repo(private=bool(req.get("private")) or req.get("visibility") == "private")
        repo.branches["main"] = self._new_commit(repo, {})
        self.repos[repo_id] = repo
        return _json(200, {"url": f"{self.url}/{repo_id}", "name": repo_id})

    def _on_validate_yaml(self, body: bytes, **_: Any) -> Response:
        content = json.loads(body)["content"]
        parts = content.split("---", 2) if content.startswith("---") else []
        if len(parts) == 3:
            try:
                yaml.safe_load(parts[1])
            except yaml.YAMLError as err:
                return _json(400, {"errors": [{"message": str(err)}], "warnings": []})
        return _json(200, {"errors": [], "warnings": []})

    def _on_branch(self, repo: str, rev: str, body: bytes, **_: Any) -> Response:
        r = self._repo(repo)
        if rev in r.branches:
            raise HubError(409, f"Branch {rev} already exists")
        start = (json.loads(body or b"{}") or {}).get("startingPoint") or "main"
        r.branches[rev] = r.branches.get(start, start)
        return _json(200, {})

    def _on_preupload(self, repo: str, rev: str, body: bytes, **_: Any) -> Response:
        tree = self._files_at(repo, rev)
        out = []
        for f in json.loads(body)["files"]:
            lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_MIN_BYTES
            existing = tree.get(f["path"])
            oid = _oid(*existing) if existing and existing[1] == lfs else None
            out.append(
                {
                    "path": f["path"],
                    "uploadMode": "lfs" if lfs else "regular",
                    "shouldIgnore": False,
                    "oid": oid,
                }
            )
        return _json(200, {"files": out})

    def _on_lfs_batch(self, repo: str, body: bytes, **_: Any) -> Response:
        self._repo(repo)
        objects = []
        for obj in json.loads(body)["objects"]:
            entry: dict[str, Any] = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.lfs:
                href = f"{self.url}/lfs-objects/{obj['oid']}"
                entry["actions"] = {"upload": {"href": href}, "verify": {"href": href + "/verify"}}
            objects.append(entry)
        status, head, payload = _json(200, {"transfer": "basic", "objects": objects})
        return status, {**head, "Content-Type": "application/vnd.git-lfs+json"}, payload

    def _on_lfs_upload(self, oid: str, body: bytes, **_: Any) -> Response:
        if hashlib.sha256(body).hexdigest() != oid:
            raise HubError(400, "uploaded content does not match its oid")
        self.lfs[oid] = body
        return 200, {}, b""

    def _on_lfs_verify(self, oid: str, body: bytes, **_: Any) -> Response:
        size = json.loads(body)["size"]
        if oid not in self.lfs or len(self.lfs[oid]) != size:
            raise HubError(404, f"LFS object {oid} was not uploaded")
        return _json(200, {})

    def _on_commit(self, repo: str, rev: str, body: bytes, **_: Any) -> Response:
        r = self._repo(repo)
        if rev not in r.branches:
            raise HubError(404, f"Branch {rev} not found", "RevisionNotFound")
        files = dict(r.commits[r.branches[rev]])
        summary = ""
        for line in body.decode().splitlines():
            op = json.loads(line)
            key, value = op["key"], op["value"]
            if key == "header":
                summary = value.get("summary", "")
            elif key == "file":
                files[value["path"]] = (base64.b64decode(value["content"]), False)
            elif key == "lfsFile":
                if value["oid"] not in self.lfs:
                    raise HubError(422, f"LFS object {value['oid']} for {value['path']} was never uploaded")
                files[value["path"]] = (self.lfs[value["oid"]], True)
            elif key == "deletedFile":
                files.pop(value["path"], None)
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                files = {p: f for p, f in files.items() if not p.startswith(prefix)}
        if not summary:
            raise HubError(400, "commit summary is required")
        oid = self._new_commit(r, files)
        r.branches[rev] = oid
        return _json(
            200, {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}
        )

    def _on_tree(self, repo: str, rev: str, path: str = "", **_: Any) -> Response:
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        out = []
        for name, (data, lfs) in sorted(self._files_at(repo, rev).items()):
            if name.startswith(prefix):
                entry: dict[str, Any] = {
                    "type": "file",
                    "path": name,
                    "size": len(data),
                    "oid": _git_oid(data),
                }
                if lfs:
                    entry["lfs"] = {
                        "oid": hashlib.sha256(data).hexdigest(),
                        "size": len(data),
                        "pointerSize": 134,
                    }
                out.append(entry)
        return _json(200, out)

    def _on_info(self, repo: str, rev: str = "main", **_: Any) -> Response:
        r = self._repo(repo)
        sha = r.branches.get(rev, rev)
        siblings = [{"rfilename": p} for p in sorted(self._files_at(repo, rev))]
        return _json(
            200, {"id": repo, "modelId": repo, "sha": sha, "private": r.private, "siblings": siblings}
        )

    def _on_refs(self, repo: str, **_: Any) -> Response:
        r = self._repo(repo)
        branches = [
            {"name": n, "ref": f"refs/heads/{n}", "targetCommit": c} for n, c in sorted(r.branches.items())
        ]
        return _json(200, {"branches": branches, "converts": [], "tags": []})

    def _on_resolve(self, repo: str, rev: str, path: str, method: str, **_: Any) -> Response:
        r = self._repo(repo)
        tree = self._files_at(repo, rev)
        if path not in tree:
            raise HubError(404, f"Entry {path} not found", "EntryNotFound")
        data, lfs = tree[path]
        head = {
            "X-Repo-Commit": r.branches.get(rev, rev),
            "ETag": f'"{_git_oid(data)}"',
            "Content-Length": str(len(data)),
        }
        if lfs:
            head.update(
                {"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Linked-Size": str(len(data))}
            )
        return 200, head, b"" if method == "HEAD" else data


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _oid(data: bytes, lfs: bool) -> str:
    """The oid `preupload` reports: sha256 for LFS files, the git blob id for regular ones."""
    return hashlib.sha256(data).hexdigest() if lfs else _git_oid(data)


def _json(status: int, payload: Any) -> Response:
    return status, {"Content-Type": "application/json"}, json.dumps(payload).encode()


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def _serve(self) -> None:
            status, headers, payload = hub.handle(self.command, self.path, self.headers, self._body())
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            if "Content-Length" not in headers:
                self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        do_GET = do_HEAD = do_POST = do_PUT = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
