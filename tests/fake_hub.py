"""A local Hub API on 127.0.0.1 for push tests: the real `huggingface_hub` upload path, no network."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

TOKEN = "hf_test_token_not_real"


class FakeHub:
    """A minimal Hub API: ``/api/repos/create``, ``/api/validate-yaml``, ``/api/models/<repo>/preupload/<rev>`` and
    ``/api/models/<repo>/commit/<rev>`` (every file "regular": content inline, base64), and ``/api/whoami-v2``
    (the token belongs to ``user``)."""

    def __init__(self, user: str = "someone"):
        self.user = user
        self.repos: dict[str, dict] = {}
        self.commits: list[dict] = []
        self.requests: list[tuple[str, str, dict]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                headers = {k.lower(): v for k, v in self.headers.items()}
                hub.requests.append(("GET", self.path, headers))
                if headers.get("authorization") != f"Bearer {TOKEN}":
                    return self._reply(401, {"error": "Invalid credentials"})
                if self.path.split("?")[0] == "/api/whoami-v2":
                    return self._reply(200, {"type": "user", "name": hub.user})
                return self._reply(404, {"error": f"no route {self.path}"})

            def do_POST(self):  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                hub.requests.append(("POST", self.path, headers))
                if headers.get("authorization") != f"Bearer {TOKEN}":
                    return self._reply(401, {"error": "Invalid credentials"})
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    body = json.loads(raw)
                    repo_id = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
                    private = body.get("private", body.get("visibility") == "private")
                    hub.repos.setdefault(repo_id, {"private": private, "files": {}})
                    return self._reply(200, {"url": f"http://{self.headers['host']}/{repo_id}", "name": repo_id})
                if path == "/api/validate-yaml":
                    content = json.loads(raw)["content"]
                    front = content.split("---")[1] if content.startswith("---") else ""
                    yaml.safe_load(front)  # a card whose metadata is not YAML fails the test (HTTP 500)
                    return self._reply(200, {"errors": [], "warnings": []})
                parts = path.strip("/").split("/")
                if len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4] == "preupload":
                    files = json.loads(raw)["files"]
                    modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                    return self._reply(200, {"files": modes})
                if len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4] == "commit":
                    repo_id = f"{parts[2]}/{parts[3]}"
                    if repo_id not in hub.repos:
                        return self._reply(404, {"error": "Repository not found"})
                    lines = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
                    header = next(item["value"] for item in lines if item["key"] == "header")
                    files = {
                        item["value"]["path"]: base64.b64decode(item["value"]["content"])
                        for item in lines
                        if item["key"] == "file"
                    }
                    others = [item["key"] for item in lines if item["key"] not in ("header", "file")]
                    hub.commits.append(
                        {
                            "repo_id": repo_id,
                            "revision": parts[5],
                            "header": header,
                            "files": files,
                            "other_keys": others,
                        }
                    )
                    hub.repos[repo_id]["files"].update(files)
                    oid = f"{len(hub.commits):040x}"
                    return self._reply(
                        200, {"commitUrl": f"http://{self.headers['host']}/{repo_id}/commit/{oid}", "commitOid": oid}
                    )
                return self._reply(404, {"error": f"no route {path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
