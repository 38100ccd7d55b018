"""A stand-in for the Hugging Face Hub on a free loopback port (HF_ENDPOINT points huggingface_hub at it).

It answers only the routes that huggingface_hub's model_info, snapshot_download, hf_hub_download and
get_safetensors_metadata call, with the headers they read:

    GET       /api/models/ORG/NAME[/revision/REV]        model info: {"id", "sha", "siblings"}
    GET       /api/models/ORG/NAME/tree/REV[/PATH]       every file: [{"type", "path", "size", "oid"}]
    HEAD, GET /ORG/NAME/resolve/REV/FILE                 X-Repo-Commit, ETag, Content-Length; Range: 206

Errors carry X-Error-Code as the Hub's do: 401 RepoNotFound (unknown id), 401 GatedRepo (a gated repo's
files without its token), 404 RevisionNotFound, 404 EntryNotFound. Every request is logged."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class Request:
    method: str
    path: str
    range: str | None  # the Range header, if any


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]]  # commit sha -> path -> content
    refs: dict[str, str]                  # branch or tag -> commit sha
    token: str | None = None              # gated: files only for this token


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    url: str = ""

    def add(self, repo_id: str, revisions: dict[str, dict[str, bytes]], token: str | None = None) -> dict[str, str]:
        """A repo whose branches each hold these files; returns branch -> commit sha."""
        refs = {ref: hashlib.sha1(f"{repo_id}@{ref}".encode()).hexdigest() for ref in revisions}
        self.repos[repo_id] = Repo({refs[ref]: files for ref, files in revisions.items()}, refs, token)
        return refs

    def start(self) -> FakeHub:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server = server
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def env(self, hf_home: str) -> dict[str, str]:
        """The variables that point huggingface_hub at this Hub, with its cache in `hf_home`."""
        return {"HF_ENDPOINT": self.url, "HF_HOME": hf_home, "HF_HUB_CACHE": f"{hf_home}/hub",
                "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0", "HF_TOKEN": ""}


_API = re.compile(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?/?$")
_TREE = re.compile(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$")
_RESOLVE = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class _HubHandler(BaseHTTPRequestHandler):
    """Answers as the Hub does for the repos of `hub` (set by _handler on a subclass)."""

    hub: FakeHub

    def log_message(self, *args) -> None:  # quiet: the requests are in hub.requests
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.requests.append(Request(self.command, path, self.headers.get("Range")))
        for pattern, route in ((_TREE, self._tree), (_API, self._info), (_RESOLVE, self._resolve)):
            match = pattern.match(path)
            if match:
                return route(body, *match.groups())
        self._error(404, "EntryNotFound", body)

    def _commit(self, repo_id: str, revision: str | None, body: bool) -> tuple[Repo, str] | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(401, "RepoNotFound", body)
        sha = repo.refs.get(revision or "main", revision if revision in repo.commits else None)
        if sha is None:
            return self._error(404, "RevisionNotFound", body)
        return repo, sha

    def _info(self, body: bool, repo_id: str, revision: str | None) -> None:
        found = self._commit(repo_id, revision, body)
        if found:
            repo, sha = found
            self._json({"id": repo_id, "sha": sha, "gated": "manual" if repo.token else False,
                        "siblings": [{"rfilename": p} for p in repo.commits[sha]]}, body)

    def _tree(self, body: bool, repo_id: str, revision: str, folder: str | None) -> None:
        found = self._commit(repo_id, revision, body)
        if found:
            repo, sha = found
            self._json([{"type": "file", "path": p, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                        for p, data in repo.commits[sha].items() if p.startswith(folder or "")], body)

    def _resolve(self, body: bool, repo_id: str, revision: str, filename: str) -> None:
        found = self._commit(repo_id, revision, body)
        if not found:
            return
        repo, sha = found
        if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
            return self._error(401, "GatedRepo", body)
        data = repo.commits[sha].get(filename)
        if data is None:
            return self._error(404, "EntryNotFound", body, {"X-Repo-Commit": sha})
        status, part = 200, data
        ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if ranged:
            start, end = int(ranged[1]), int(ranged[2] or len(data) - 1)
            status, part = 206, data[start:end + 1]
        self.send_response(status)
        self.send_header("X-Repo-Commit", sha)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Content-Length", str(len(part)))
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{start + len(part) - 1}/{len(data)}")
        self.end_headers()
        if body:
            self.wfile.write(part)

    def _json(self, value: object, body: bool) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, status: int, code: str, body: bool, headers: dict | None = None) -> None:
        data = json.dumps({"error": code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)



def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    return type("Handler", (_HubHandler,), {"hub": hub})
