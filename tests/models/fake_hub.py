"""A fake Hugging Face hub on 127.0.0.1, for tests that download without the internet.

It answers the calls that huggingface_hub's `snapshot_download` and `hf_hub_download` make
(and so transformers' `from_pretrained` on a hub id):

    GET  /api/models/{org}/{name}/revision/{revision}     the repo's info at a revision
    GET  /api/models/{org}/{name}/tree/{revision}[/path]  its files (size, blob id)
    HEAD /{org}/{name}/resolve/{revision}/{file}          X-Repo-Commit, ETag, Content-Length
    GET  /{org}/{name}/resolve/{revision}/{file}          the file

A revision is a branch or tag name or a commit id (40 hex digits). Errors carry the
X-Error-Code header from which huggingface_hub raises its own exceptions: RepoNotFound,
RevisionNotFound, EntryNotFound, and GatedRepo for a gated repo's files asked for without
its token (`Authorization: Bearer <token>`; its info and file list stay public, as on the
real hub). Every request is recorded with its Authorization header (`FakeHub.requests`).

Point huggingface_hub at it with `hub.pointed_at(monkeypatch)` in the test's process, or
with the environment of `hub.environment()` in a child process (HF_ENDPOINT is read when
huggingface_hub is imported).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

from aiohttp import web


@dataclass
class FakeRepo:
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit id
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit id -> files
    token: str | None = None  # a gated repo's files need it


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    authorization: str | None


class FakeHub:
    """Repos held in memory, served by an aiohttp server on its own thread and loop."""

    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[Request] = []
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    def add(
        self,
        repo_id: str,
        revision: str,
        files: Mapping[str, bytes] | Path,
        token: str | None = None,
    ) -> str:
        """Commit `files` (a mapping, or every file of a folder) to `repo_id` under the branch
        or tag `revision`; its commit id. `token` gates the repo."""
        if isinstance(files, Path):
            files = {
                str(p.relative_to(files)): p.read_bytes() for p in files.rglob("*") if p.is_file()
            }
        repo = self.repos.setdefault(repo_id, FakeRepo())
        repo.token = token if token is not None else repo.token
        digest = hashlib.sha1(repo_id.encode() + revision.encode())
        for name in sorted(files):
            digest.update(name.encode() + hashlib.sha1(files[name]).digest())
        commit = digest.hexdigest()
        repo.commits[commit] = dict(files)
        repo.refs[revision] = commit
        return commit

    def files_fetched(self, repo_id: str) -> list[str]:
        """The paths of the GET .../resolve/... requests for `repo_id`, in order."""
        prefix = f"/{repo_id}/resolve/"
        return [r.path for r in self.requests if r.method == "GET" and r.path.startswith(prefix)]

    # --- pointing huggingface_hub at it --------------------------------------------------

    def environment(self) -> dict[str, str]:
        return {"HF_ENDPOINT": self.url}

    def pointed_at(self, monkeypatch) -> None:
        """Point this process's huggingface_hub at the fake hub (until the test ends)."""
        import huggingface_hub.constants as constants

        monkeypatch.setattr(constants, "ENDPOINT", self.url)
        template = self.url + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    # --- the server ----------------------------------------------------------------------

    @contextmanager
    def running(self) -> Iterator[FakeHub]:
        started = threading.Event()
        self._loop = asyncio.new_event_loop()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="fake-hub", daemon=True)
        self._thread.start()
        started.wait(10)
        try:
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        authorization = request.headers.get("Authorization")
        self.requests.append(Request(request.method, request.path, authorization))
        try:
            return self._answer(request, authorization)
        except _HubError as error:
            headers = {"X-Error-Code": error.code, "X-Error-Message": str(error)}
            return web.Response(status=error.status, headers=headers, text=str(error))

    def _answer(self, request: web.Request, authorization: str | None) -> web.Response:
        parts = [unquote(p) for p in request.raw_path.split("?")[0].split("/")[1:]]
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo_id, action, revision = "/".join(parts[2:4]), parts[4], parts[5]
            repo, commit = self._find(repo_id, revision)
            if action == "revision":
                return _info(repo_id, commit, repo)
            if action == "tree":
                return _tree(repo.commits[commit], "/".join(parts[6:]))
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo_id, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            repo, commit = self._find(repo_id, revision)
            if repo.token is not None and authorization != f"Bearer {repo.token}":
                raise _HubError(401 if authorization is None else 403, "GatedRepo", repo_id)
            files = repo.commits[commit]
            if name not in files:
                raise _HubError(404, "EntryNotFound", f"{name} at {revision}")
            return _file(files[name], commit, request.method == "HEAD")
        raise _HubError(404, "NotFound", request.path)

    def _find(self, repo_id: str, revision: str) -> tuple[FakeRepo, str]:
        repo = self.repos.get(repo_id)
        if repo is None:
            raise _HubError(404, "RepoNotFound", repo_id)
        commit = revision if revision in repo.commits else repo.refs.get(revision)
        if commit is None:
            raise _HubError(404, "RevisionNotFound", f"{repo_id}@{revision}")
        return repo, commit


class _HubError(Exception):
    def __init__(self, status: int, code: str, what: str) -> None:
        super().__init__(f"{code}: {what}")
        self.status, self.code = status, code


def _info(repo_id: str, commit: str, repo: FakeRepo) -> web.Response:
    body = {
        "id": repo_id,
        "modelId": repo_id,
        "sha": commit,
        "private": False,
        "gated": "manual" if repo.token else False,
        "siblings": [{"rfilename": name} for name in sorted(repo.commits[commit])],
    }
    return web.json_response(body)


def _tree(files: dict[str, bytes], folder: str) -> web.Response:
    prefix = f"{folder}/" if folder else ""
    entries = [
        {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
        for name, data in sorted(files.items())
        if name.startswith(prefix)
    ]
    return web.Response(text=json.dumps(entries), content_type="application/json")


def _file(data: bytes, commit: str, head: bool) -> web.Response:
    headers = {
        "X-Repo-Commit": commit,
        "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
        "Content-Length": str(len(data)),
    }
    if head:
        return web.Response(status=200, headers=headers)
    return web.Response(body=data, headers=headers, content_type="application/octet-stream")
