"""An S3 server on loopback (moto's) for the tests that read prompts from object storage.

``s3_server()`` yields the environment a Ray job needs to reach it (what a user
passes with ``nnsight-ray submit --env`` for an S3-compatible store such as
MinIO: ``AWS_ENDPOINT_URL`` and the credentials) and a ``pyarrow`` filesystem
for the test to put files in. pyarrow (which Ray Data reads S3 with) honours
``AWS_ENDPOINT_URL``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def s3_server(bucket: str = "prompts") -> Iterator[tuple[dict[str, str], object]]:
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
        filesystem = pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"], access_key="test",
                                       secret_key="test", region="us-east-1", allow_bucket_creation=True)
        filesystem.create_dir(bucket)
        yield env, filesystem
    finally:
        server.stop()


@contextlib.contextmanager
def hub_server(files: dict[str, bytes], repo: str = "org/prompts") -> Iterator[dict[str, str]]:
    """A read-only Hugging Face Hub on loopback serving one dataset repo's ``files`` (path -> bytes).

    Enough of the Hub's HTTP API for ``huggingface_hub``'s ``HfFileSystem``
    (what ``hf://datasets/...`` paths are read with): the repo's info, its tree,
    paths-info and ranged downloads. Yields the environment that points a
    process at it (``HF_ENDPOINT``).
    """
    import hashlib
    import json
    import posixpath
    import re
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import parse_qs, unquote, urlparse

    sha = "0" * 40
    api = re.compile(rf"^/api/datasets/{re.escape(repo)}(?:/(revision|tree|paths-info)/[^/]+(/.*)?)?$")
    resolve = re.compile(rf"^/datasets/{re.escape(repo)}/resolve/[^/]+/(.+)$")
    folders = {posixpath.dirname(p) for p in files} | {""}
    folders |= {posixpath.dirname(f) for f in list(folders) if f}

    def entry(path: str) -> dict:
        if path in files:
            return {"type": "file", "path": path, "size": len(files[path]),
                    "oid": hashlib.sha1(files[path]).hexdigest()}
        return {"type": "directory", "path": path, "oid": sha}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, status: int, body: bytes, headers: dict | None = None):
            self.send_response(status)
            for key, value in {"Content-Length": str(len(body)), "X-Repo-Commit": sha, **(headers or {})}.items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def json(self, value):
            self.reply(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

        def missing(self):
            self.reply(404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"})

        def do_GET(self):
            url = urlparse(self.path)
            if match := api.match(url.path):
                kind, sub = match.group(1), unquote(match.group(2) or "").strip("/")
                if kind in (None, "revision"):
                    return self.json({"id": repo, "sha": sha, "private": False,
                                      "siblings": [{"rfilename": p} for p in files]})
                if kind == "tree":
                    if sub not in folders:
                        return self.missing()
                    recursive = parse_qs(url.query).get("recursive", [""])[0].lower() == "true"
                    inside = [p for p in sorted(files | dict.fromkeys(folders - {""}))
                              if p.startswith(sub + "/" if sub else "")
                              and (recursive or posixpath.dirname(p) == sub)]
                    return self.json([entry(p) for p in inside])
            if match := resolve.match(url.path):
                path = unquote(match.group(1))
                if path not in files:
                    return self.missing()
                data, ranged = files[path], self.headers.get("Range")
                if ranged:
                    start, _, end = ranged.removeprefix("bytes=").partition("-")
                    end = min(int(end) if end else len(data) - 1, len(data) - 1)
                    return self.reply(206, data[int(start):end + 1],
                                      {"Content-Range": f"bytes {start}-{end}/{len(data)}", "ETag": f'"{entry(path)["oid"]}"'})
                return self.reply(200, data, {"ETag": f'"{entry(path)["oid"]}"'})
            return self.missing()

        do_HEAD = do_GET

        def do_POST(self):
            url = urlparse(self.path)
            match = api.match(url.path)
            if not match or match.group(1) != "paths-info":
                return self.missing()
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
            asked = parse_qs(body).get("paths", [])
            return self.json([entry(p) for p in asked if p in files or p in folders])

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}", "HF_HUB_DISABLE_TELEMETRY": "1"}
    finally:
        server.shutdown()
        server.server_close()
