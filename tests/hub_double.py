"""A TEST DOUBLE of the Hugging Face Hub's write API. It is not the Hub and not a mirror.

It answers only the calls huggingface_hub 2.4 makes to create a repo and a branch, read a
file (HEAD/GET .../resolve/...) and create a commit:

    POST /api/repos/create                            -> 200, or 409 when the repo exists
    POST /api/models/{repo}/branch/{branch}           -> 200, or 409 when the branch exists
    GET  /api/models/{repo}[/revision/{revision}]     -> minimal repo info (file list)
    GET  /api/models/{repo}/tree/{revision}           -> every file, one page (snapshot_download)
    HEAD|GET /{repo}/resolve/{revision}/{path}        -> file, X-Repo-Commit and ETag headers
    POST /api/validate-yaml                           -> the README's front matter must parse
    POST /api/models/{repo}/preupload/{revision}      -> uploadMode "regular" for every file,
                                                         so contents come inline, base64
    POST /api/models/{repo}/commit/{revision}         -> NDJSON: a header, then "file" lines

Space repos (`repo_type="space"`) take the same calls under /api/spaces/. A fresh process
whose HF_ENDPOINT is the double asks once for the AI-agent registry (for its user agent):

    GET  /api/agent-harnesses                         -> an empty registry
Repos live in memory (one dict of files per branch). Every commit and request is recorded.
Writes need `Authorization: Bearer <token>`; anything else is answered 501 and recorded
in `unexpected`, so a test notices when huggingface_hub starts calling something new.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import yaml

REPO = r"(?P<repo>[^/]+/[^/]+)"
KIND = r"(?:models|spaces)"  # model repos and Space repos answer alike here; Repo.kind tells them apart
ROUTES = [  # (method, pattern, handler name)
    ("POST", r"/api/repos/create", "create_repo"),
    ("GET", r"/api/agent-harnesses", "agent_harnesses"),
    ("POST", rf"/api/{KIND}/{REPO}/branch/(?P<branch>[^/]+)", "create_branch"),
    ("GET", rf"/api/{KIND}/{REPO}", "repo_info"),
    ("GET", rf"/api/{KIND}/{REPO}/revision/(?P<revision>[^/]+)", "repo_info"),
    ("GET", rf"/api/{KIND}/{REPO}/tree/(?P<revision>[^/]+)", "tree"),
    ("HEAD", rf"/{REPO}/resolve/(?P<revision>[^/]+)/(?P<path>.+)", "resolve"),
    ("GET", rf"/{REPO}/resolve/(?P<revision>[^/]+)/(?P<path>.+)", "resolve"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
    ("POST", rf"/api/{KIND}/{REPO}/preupload/(?P<revision>[^/]+)", "preupload"),
    ("POST", rf"/api/{KIND}/{REPO}/commit/(?P<revision>[^/]+)", "commit"),
]


@dataclasses.dataclass
class Commit:
    repo_id: str
    branch: str
    summary: str
    files: dict[str, bytes]
    oid: str


@dataclasses.dataclass
class Branch:
    files: dict[str, bytes]
    oid: str


@dataclasses.dataclass
class Repo:
    private: bool
    branches: dict[str, Branch]
    kind: str = "model"  # or "space", as create_repo asked
    sdk: str | None = None  # a Space's, as create_repo asked
    snapshots: dict[str, dict[str, bytes]] = dataclasses.field(default_factory=dict)  # commit -> every file then


class HubDouble:
    """Serve on 127.0.0.1 in a thread: `with HubDouble(token) as hub: hub.url ...`."""

    def __init__(self, token: str):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.commits: list[Commit] = []
        self.requests: list[str] = []  # "METHOD /path"
        self.unexpected: list[str] = []
        self.validated_cards: list[str] = []
        handler = type("Handler", (_Handler,), {"hub": self})  # the handler class reaches its hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "HubDouble":
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def files(self, repo_id: str, branch: str = "main") -> dict[str, bytes]:
        return self.repos[repo_id].branches[branch].files

    def put_file(self, repo_id: str, path: str, content: bytes, branch: str = "main") -> None:
        """What a person editing a file on the Hub's website does (a commit of one file)."""
        self._apply(repo_id, branch, f"Update {path}", {path: content})

    def _apply(self, repo_id: str, branch: str, summary: str, files: dict[str, bytes]) -> Commit:
        head = self.repos[repo_id].branches[branch]
        oid = hashlib.sha1(f"{head.oid}{summary}{sorted(files)}{len(self.commits)}".encode()).hexdigest()
        head.files.update(files)
        head.oid = oid
        self.repos[repo_id].snapshots[oid] = dict(head.files)
        commit = Commit(repo_id, branch, summary, dict(files), oid)
        self.commits.append(commit)
        return commit


@contextlib.contextmanager
def serving_hub(monkeypatch, cache: Path, token: str):
    """A HubDouble that huggingface_hub talks to: HF_ENDPOINT and HF_TOKEN point at it, online,
    with a fresh cache at `cache`. On exit, every request it got must have been one it serves."""
    from huggingface_hub import constants

    with HubDouble(token) as double:
        monkeypatch.setenv("HF_ENDPOINT", double.url)
        monkeypatch.setenv("HF_TOKEN", token)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
        yield double
    assert double.unexpected == [], double.unexpected


class _Handler(BaseHTTPRequestHandler):
    hub: HubDouble

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    # Routing and replies ------------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path
        self.hub.requests.append(f"{method} {path}")
        for route_method, pattern, name in ROUTES:
            match = re.fullmatch(pattern, path)
            if route_method == method and match:
                params = {key: unquote(value) for key, value in match.groupdict().items()}
                getattr(self, name)(**params)
                return
        self.hub.unexpected.append(f"{method} {path}")
        self._reply(501, {"error": f"the test double does not implement {method} {path}"})

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def _reply(self, status: int, payload: dict | None = None, headers: dict | None = None,
               body: bytes | None = None) -> None:
        data = body if body is not None else json.dumps(payload or {}).encode()
        self.send_response(status)
        for key, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                           **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str) -> None:
        self._reply(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {self.hub.token}":
            return True
        self._error(401, "Unauthorized", "Invalid credentials in Authorization header")
        return False

    def _branch(self, repo: str, revision: str) -> Branch | None:
        """The branch named `revision` or whose head commit it is (or the files at an older
        commit, as a detached branch), or None after answering 404."""
        if repo not in self.hub.repos or (self.hub.repos[repo].private and not self._has_token()):
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        branches = self.hub.repos[repo].branches
        branch = branches.get(revision) or next((b for b in branches.values() if b.oid == revision), None)
        snapshot = self.hub.repos[repo].snapshots.get(revision)
        if branch is None and snapshot is not None:
            branch = Branch(files=snapshot, oid=revision)
        if branch is None:
            self._error(404, "RevisionNotFound", "Invalid rev id")
        return branch

    def _has_token(self) -> bool:
        return self.headers.get("Authorization") == f"Bearer {self.hub.token}"

    # Endpoints ----------------------------------------------------------------------------
    def create_repo(self) -> None:
        request = json.loads(self._body())
        if not self._authorized():
            return
        repo = f"{request['organization']}/{request['name']}"
        if repo in self.hub.repos:
            self._reply(409, {"error": "You already created this model repo", "url": f"{self.hub.url}/{repo}"})
            return
        initial = hashlib.sha1(repo.encode()).hexdigest()
        private = request.get("visibility") == "private"
        self.hub.repos[repo] = Repo(private=private, branches={"main": Branch(files={}, oid=initial)},
                                    kind=request.get("type") or "model", sdk=request.get("sdk"))
        self._reply(200, {"url": f"{self.hub.url}/{repo}", "name": repo})

    def agent_harnesses(self) -> None:
        self._reply(200, {"standardEnvVars": [], "harnesses": {}})

    def create_branch(self, repo: str, branch: str) -> None:
        self._body()
        if not self._authorized() or self._branch(repo, "main") is None:
            return
        branches = self.hub.repos[repo].branches
        if branch in branches:
            self._error(409, "BranchExists", "Reference already exists")
            return
        branches[branch] = Branch(files=dict(branches["main"].files), oid=branches["main"].oid)
        self._reply(200, {})

    def repo_info(self, repo: str, revision: str = "main") -> None:
        branch = self._branch(repo, revision)
        if branch is not None:
            self._reply(200, {"id": repo, "sha": branch.oid, "private": self.hub.repos[repo].private,
                              "siblings": [{"rfilename": name} for name in sorted(branch.files)]})

    def tree(self, repo: str, revision: str) -> None:
        branch = self._branch(repo, revision)
        if branch is not None:
            entries = [{"type": "file", "path": name, "size": len(content), "oid": hashlib.sha1(content).hexdigest()}
                       for name, content in sorted(branch.files.items())]
            self._reply(200, body=json.dumps(entries).encode())

    def resolve(self, repo: str, revision: str, path: str) -> None:
        branch = self._branch(repo, revision)
        if branch is None:
            return
        if path not in branch.files:
            self._error(404, "EntryNotFound", f"{path} does not exist on {revision}")
            return
        content = branch.files[path]
        self._reply(200, body=content, headers={
            "Content-Type": "application/octet-stream", "X-Repo-Commit": branch.oid,
            "ETag": f'"{hashlib.sha1(content).hexdigest()}"'})

    def validate_yaml(self) -> None:
        content = json.loads(self._body())["content"]
        self.hub.validated_cards.append(content)
        front = re.match(r"---\n(.*?)\n---\n", content, re.DOTALL)
        try:
            metadata = yaml.safe_load(front.group(1)) if front else None
        except yaml.YAMLError as error:
            self._reply(400, {"errors": [{"message": str(error)}]}, {"X-Error-Code": "BadRequest"})
            return
        if not isinstance(metadata, dict):
            self._reply(400, {"errors": [{"message": "no YAML metadata block"}]})
            return
        self._reply(200, {"errors": [], "warnings": []})

    def preupload(self, repo: str, revision: str) -> None:
        request = json.loads(self._body())
        if not self._authorized() or self._branch(repo, revision) is None:
            return
        self._reply(200, {"files": [{"path": file["path"], "uploadMode": "regular", "shouldIgnore": False}
                                    for file in request["files"]]})

    def commit(self, repo: str, revision: str) -> None:
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        if not self._authorized() or self._branch(repo, revision) is None:
            return
        header = lines[0]["value"]
        files = {}
        for line in lines[1:]:
            if line["key"] != "file" or line["value"].get("encoding") != "base64":
                self._reply(400, {"error": f"the test double only takes inline files, got {line['key']}"})
                return
            files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
        commit = self.hub._apply(repo, revision, header["summary"], files)
        self._reply(200, {"commitUrl": f"{self.hub.url}/{repo}/commit/{commit.oid}", "commitOid": commit.oid,
                          "success": True})
