"""Test infrastructure for object stores: a moto S3 server on 127.0.0.1 and a fault-injecting
HTTP proxy in front of it (both real HTTP, nothing mocked in the client)."""

from __future__ import annotations

import http.client
import logging
import random
import socket
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class S3Server:
    """moto's ThreadedMotoServer on 127.0.0.1, port 0."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def reset(self) -> None:
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=30).read()

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
        ).create_bucket(Bucket=name)

    def stop(self) -> None:
        self._server.stop()


def storage_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "key": "test",
        "secret": "test",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }
    opts.update(extra)
    return opts


class FaultyProxy:
    """A loopback HTTP proxy that fails a fraction of requests: half with 503 SlowDown, half by
    dropping the connection without an answer. ``rate`` may be changed while it runs."""

    def __init__(self, upstream: str, rate: float, seed: int = 0) -> None:
        self.rate = rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts = {"forwarded": 0, "503": 0, "dropped": 0}
        self.forwarded: list[str] = []  # "METHOD /path?query" of each forwarded request
        host, port = upstream.removeprefix("http://").split(":")
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy.lock:
                    roll = proxy.rng.random()
                    fail = roll < proxy.rate
                    drop = fail and roll < proxy.rate / 2
                if drop:
                    proxy.counts["dropped"] += 1
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fail:
                    proxy.counts["503"] += 1
                    msg = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                proxy.counts["forwarded"] += 1
                proxy.forwarded.append(f"{self.command} {self.path}")
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in (
                        "connection",
                        "keep-alive",
                        "transfer-encoding",
                        "content-length",
                        "server",
                        "date",
                    ):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            def _safe(self) -> None:
                try:
                    self._handle()
                except (BrokenPipeError, ConnectionResetError):  # the client gave up: fine
                    self.close_connection = True

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _safe

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="faulty-proxy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
