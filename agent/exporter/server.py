"""The HTTP side of an endpoint: GET /metrics answers with the rendered exposition.

A small threading HTTP server from the standard library. Each connection is served on its
own daemon thread, and HTTP/1.1 keep-alive lets Prometheus reuse one connection per target.
GET and HEAD answer with the exposition. POST /profile?step=N asks the rank for a profiler
window whose first step is N (`diag top`'s `p`, which gives every rank the same N so they
profile the same steps); it changes nothing else, and a rank with profiling off answers 409.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from diag.exporter.registry import CONTENT_TYPE

INDEX = b"<html><head><title>diag</title></head><body><a href=\"/metrics\">metrics</a></body></html>\n"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body are two writes; with Nagle's algorithm and the client's delayed ACK a
    # kept-alive connection (as Prometheus keeps) would wait ~40 ms on every scrape.
    disable_nagle_algorithm = True
    server_version = "diag-exporter"
    # A scraper that opens a connection and never sends a request must not hold a thread forever.
    timeout = 30

    def _answer(self, head: bool) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/metrics", "/metrics/"):
            try:
                body, ctype, status = self.server.render(), CONTENT_TYPE, 200
            except Exception as exc:
                self.server.on_error()
                body, ctype, status = f"diag exporter: {type(exc).__name__}\n".encode(), "text/plain", 500
        elif path == "/":
            body, ctype, status = INDEX, "text/html; charset=utf-8", 200
        else:
            body, ctype, status = b"not found; metrics are at /metrics\n", "text/plain", 404
        self._send(status, body, ctype, head)

    def _send(self, status: int, body: bytes, ctype: str = "text/plain", head: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def do_POST(self):  # noqa: N802 - the http.server naming
        path, _, query = self.path.partition("?")
        # A body is never read: drain what a client sent, bounded, so the connection stays usable.
        length = self.headers.get("Content-Length", "0")
        if length.isdigit() and 0 < int(length) <= 4096:
            self.rfile.read(int(length))
        if path != "/profile" or self.server.on_profile is None:
            self._send(404, b"not found; POST /profile?step=N requests a profiler window\n")
            return
        step = _query_step(query)
        if step is False:
            self._send(400, b"step must be a step number\n")
            return
        try:
            first = self.server.on_profile(step)
        except Exception as exc:
            self.server.on_error()
            self._send(500, f"diag exporter: {type(exc).__name__}\n".encode())
            return
        if first is None:
            self._send(409, b"profiling is off on this rank\n")
            return
        self._send(200, json.dumps({"first_step": first}).encode(), "application/json")

    def do_GET(self):  # noqa: N802 - the http.server naming
        self._answer(head=False)

    def do_HEAD(self):  # noqa: N802
        self._answer(head=True)

    def log_message(self, format, *args):  # noqa: A002 - silence per-request logging
        pass


def _query_step(query: str):
    """The `step` of a query string: an int, None when absent, False when malformed."""
    for part in query.split("&"):
        key, _, value = part.partition("=")
        if key == "step":
            return int(value) if value.isdigit() and len(value) <= 12 else False
    return None


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True
    # SO_REUSEADDR: a port left in TIME_WAIT by an earlier run is reused; on Linux a port
    # another process listens on still fails with EADDRINUSE, which start() reports.
    allow_reuse_address = True

    def __init__(self, address, render, on_error=lambda: None, on_profile=None):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.render = render
        self.on_error = on_error
        self.on_profile = on_profile
        super().__init__(address, _Handler)
        self.thread: threading.Thread | None = None

    def start(self) -> MetricsServer:
        # A short poll interval so close() returns quickly at the end of training.
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1},
                                       name="diag-exporter", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self.thread is not None:
            self.thread.join(timeout=2.0)

    @property
    def port(self) -> int:
        return self.server_address[1]
