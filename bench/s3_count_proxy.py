#!/usr/bin/env python3
"""s3_count_proxy.py - a plain-HTTP forwarding proxy that counts S3 requests.

Usage: s3_count_proxy.py LISTEN_PORT UPSTREAM_HOST:PORT

Every request is forwarded as it is (headers and body; the S3 server in the
tests does not check signatures against the host) and counted by method,
with GETs that carry a Range header counted apart. `GET /__counts` answers
the counts as JSON, `POST /__reset` zeroes them. Used by bench/packs.sh to
report how many requests a push and a fresh pull make.
"""

import http.client
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COUNTS = {}
LOCK = threading.Lock()
UPSTREAM = ("127.0.0.1", 39123)


def count(key, n=1):
    with LOCK:
        COUNTS[key] = COUNTS.get(key, 0) + n


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def forward(self):
        if self.path == "/__counts":
            with LOCK:
                body = json.dumps(COUNTS, sort_keys=True).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.path == "/__reset":
            with LOCK:
                COUNTS.clear()
            self.send_response(204)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        method = self.command
        if method == "GET" and self.headers.get("Range"):
            count("GET (ranged)")
        elif method == "GET" and "list-type=" in self.path:
            count("LIST")
        else:
            count(method)
        if method == "PUT" and body:
            count("bytes up", len(body))
        conn = http.client.HTTPConnection(*UPSTREAM, timeout=120)
        headers = {k: v for k, v in self.headers.items()}
        conn.request(method, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        if method == "GET":
            count("bytes down", len(data))
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() in ("transfer-encoding", "connection"):
                continue
            if k.lower() == "content-length" and method != "HEAD":
                continue
            self.send_header(k, v)
        if method != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(data)
        conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward


def main():
    global UPSTREAM
    port = int(sys.argv[1])
    host, up_port = sys.argv[2].split(":")
    UPSTREAM = (host, int(up_port))
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
