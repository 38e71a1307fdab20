"""The HTTP side of an endpoint: GET /metrics answers with the rendered exposition.

A small threading HTTP server from the standard library, bounded so that no client can take
from the training what it needs. Each connection is served on its own daemon thread, and
HTTP/1.1 keep-alive lets Prometheus reuse one connection per target; but
- at most MAX_CONNECTIONS are open at once, and none once fewer than FD_RESERVE descriptors
  are left to the process. Past either, a new connection takes the place of the one that has
  waited longest for a whole request (idle, or trickling its headers): a scrape sends its
  request at once and is answered, so a flood of idle or slow clients can not keep /metrics
  from answering. With none waiting, the new one is closed at once (logged once);
- a request's headers and body must arrive within REQUEST_DEADLINE_S of its first line,
  however slowly they trickle, and a kept-alive connection may wait IDLE_TIMEOUT_S for its
  next request: a reaper closes what overstays;
- a client that goes away (a scrape timeout) is no traceback.

GET and HEAD answer with the exposition, open as Prometheus expects. POST /profile?step=N
asks the rank for a profiler window whose first step is N (`diag top`'s `p`, which gives
every rank the same N so they profile the same steps). It is control, not metrics: it is
accepted from loopback, or with the job's token (`X-Diag-Token`, from DIAG_EXPORTER_TOKEN),
and refused from browsers (any Origin header, form content types, a Host that names no
address of this node), so a web page a user opens on a cluster node cannot trigger it. The
rank decides the rest (a plausible step, a rate and a cap, and none once training ended):
its refusal is a 409 with the reason.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from diag.exporter.registry import CONTENT_TYPE

INDEX = b"<html><head><title>diag</title></head><body><a href=\"/metrics\">metrics</a></body></html>\n"

MAX_CONNECTIONS = 64  # open connections served at once (Prometheus keeps one per target)
FD_RESERVE = 64  # descriptors always left to the training process
REQUEST_DEADLINE_S = 10.0  # a request's headers and body, from its first line
IDLE_TIMEOUT_S = 30.0  # a kept-alive connection waiting for its next request
BACKLOG = 128
# Content types a browser may send cross-origin without asking first (a form post).
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data", "text/plain")
TOKEN_HEADER = "X-Diag-Token"


class ProfileRefused(Exception):
    """The rank refuses a profiler window asked for over the endpoint; the message says why."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body are two writes; with Nagle's algorithm and the client's delayed ACK a
    # kept-alive connection (as Prometheus keeps) would wait ~40 ms on every scrape.
    disable_nagle_algorithm = True
    server_version = "diag-exporter"
    server: MetricsServer  # the server that made this handler (socketserver sets it)
    # A scraper that opens a connection and never sends a request must not hold a thread forever
    # (the reaper closes it; this bounds each read in between).
    timeout = IDLE_TIMEOUT_S

    def setup(self):
        super().setup()
        self.connection.settimeout(self.server.idle_timeout_s)

    def handle_one_request(self):
        self.server.deadline(self.connection, self.server.idle_timeout_s)
        self.server.waiting(self.connection, True)
        super().handle_one_request()

    def parse_request(self):
        # The request line has come: its headers and body get request_deadline_s in all.
        self.server.deadline(self.connection, self.server.request_deadline_s)
        parsed = super().parse_request()
        self.server.waiting(self.connection, False)
        return parsed

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
        refusal = self._control_refusal()
        if refusal:
            self._send(403, refusal.encode() + b"\n")
            return
        step = _query_step(query)
        if step is False:
            self._send(400, b"step must be a step number\n")
            return
        try:
            first = self.server.on_profile(step)
        except ProfileRefused as exc:
            self._send(409, f"{exc}\n".encode())
            return
        except Exception as exc:
            self.server.on_error()
            self._send(500, f"diag exporter: {type(exc).__name__}\n".encode())
            return
        if first is None:
            self._send(409, b"profiling is off on this rank\n")
            return
        self._send(200, json.dumps({"first_step": first}).encode(), "application/json")

    def _control_refusal(self) -> str | None:
        """Why a control request may not act, or None: browsers' requests, and any from off this
        node without the job's token."""
        if self.headers.get("Origin") is not None:
            return "cross-origin requests are refused"
        ctype = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if ctype in FORM_TYPES:
            return f"content type {ctype} is refused (send none, or application/json)"
        if not _host_is_this_node(self.headers.get("Host"), self.server.node_names()):
            return "the Host header names no address of this node"
        token = self.server.token
        given = self.headers.get(TOKEN_HEADER)
        if token and given is not None and hmac.compare_digest(given.encode(), token.encode()):
            return None
        if _is_loopback(self.client_address[0]):
            return None
        return ("control requests are taken from this node only, or with the job's token "
                f"({TOKEN_HEADER}, from DIAG_EXPORTER_TOKEN)")

    def do_GET(self):  # noqa: N802 - the http.server naming
        self._answer(head=False)

    def do_HEAD(self):  # noqa: N802
        self._answer(head=True)

    def log_message(self, format, *args):  # noqa: A002 - silence per-request logging
        pass


def _is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _host_is_this_node(host: str | None, names: frozenset) -> bool:
    """Whether a Host header names this node (a name or address of it, any port): a page from
    another origin that reaches the port through a rebound DNS name names its own host."""
    if not host:
        return True  # HTTP/1.0 clients send none; a browser always does
    host = host.strip().lower()
    if host.startswith("["):
        name = host[1:host.find("]")] if "]" in host else host[1:]
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return name in names or _is_loopback(name)


def node_names(bind: str) -> frozenset:
    """The names and addresses a request to this node may give as its Host."""
    names = {"localhost", bind.lower()} if bind else {"localhost"}
    try:
        hostname = socket.gethostname()
        names |= {hostname.lower(), socket.getfqdn().lower()}
        names |= {str(info[4][0]) for info in socket.getaddrinfo(hostname, None)}
    except OSError:
        pass
    try:  # every interface's addresses: a scraper or diag top may name the node by any of them
        import psutil

        names |= {a.address.split("%", 1)[0].lower() for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family in (socket.AF_INET, socket.AF_INET6)}
    except Exception:
        pass
    return frozenset(n for n in names if n and n not in ("0.0.0.0", "::"))


def fds_left() -> int | None:
    """Descriptors this process may still open (None where that cannot be read)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return None
        return soft - len(os.listdir("/proc/self/fd"))
    except (ImportError, OSError, ValueError):
        return None


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
    request_queue_size = BACKLOG

    def __init__(self, address, render, on_error=lambda: None, on_profile=None, log=None,
                 max_connections: int = MAX_CONNECTIONS, fd_reserve: int = FD_RESERVE, token: str | None = None,
                 request_deadline_s: float = REQUEST_DEADLINE_S, idle_timeout_s: float = IDLE_TIMEOUT_S):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.render = render
        self.on_error = on_error
        self.on_profile = on_profile
        self.log = log
        self.max_connections, self.fd_reserve = max_connections, fd_reserve
        self.request_deadline_s, self.idle_timeout_s = request_deadline_s, idle_timeout_s
        self.token = token if token is not None else (os.environ.get("DIAG_EXPORTER_TOKEN") or None)
        self._names: frozenset | None = None
        self._deadlines: dict[socket.socket, float] = {}
        # Connections still waiting for a whole request, by when they began waiting: the first
        # given up when a new one comes past the bounds.
        self._waiting: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._shed_logged = False
        self.shed = 0  # connections closed at once: past the cap, or short of descriptors
        super().__init__(address, _Handler)
        self.thread: threading.Thread | None = None
        self._reaper: threading.Thread | None = None
        self._stopping = threading.Event()

    def node_names(self) -> frozenset:
        """This node's names and addresses, found at the first control request: a reverse DNS
        lookup may wait, and no rank's start should."""
        if self._names is None:
            self._names = node_names(str(self.server_address[0]))
        return self._names

    # -- bounds -------------------------------------------------------------------------

    def deadline(self, conn: socket.socket, seconds: float) -> None:
        with self._lock:
            if conn in self._deadlines:
                self._deadlines[conn] = time.monotonic() + seconds

    def waiting(self, conn: socket.socket, waits: bool) -> None:
        """A connection begins to wait for a whole request (True), or has one (False)."""
        with self._lock:
            if not waits:
                self._waiting.pop(conn, None)
            elif conn in self._deadlines:
                self._waiting[conn] = time.monotonic()

    def verify_request(self, request, client_address) -> bool:
        with self._lock:
            open_now = len(self._deadlines)
        left = fds_left() if self.fd_reserve else None
        if open_now < self.max_connections and (left is None or left >= self.fd_reserve):
            return True
        self.shed += 1
        if not self._shed_logged and self.log is not None:
            self._shed_logged = True
            why = (f"{open_now} connections open (at most {self.max_connections})" if open_now >= self.max_connections
                   else f"{left} descriptors left to the process (kept: {self.fd_reserve})")
            self.log(f"exporter: giving up the connections that wait longest for a request while {why}; "
                     "the training's own files come first")
        # The threads of connections given up take a moment to end: never twice the cap open.
        return open_now < 2 * self.max_connections and self._give_up_longest_waiting()

    def _give_up_longest_waiting(self) -> bool:
        """Close the connection that has waited longest for a whole request; False if none waits."""
        with self._lock:
            if not self._waiting:
                return False
            conn = min(self._waiting, key=self._waiting.__getitem__)
            del self._waiting[conn]
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return True

    def process_request(self, request, client_address):
        now = time.monotonic()
        with self._lock:
            self._deadlines[request] = now + self.idle_timeout_s
            self._waiting[request] = now
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._lock:
            self._deadlines.pop(request, None)
            self._waiting.pop(request, None)
        super().shutdown_request(request)

    def get_request(self):
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                time.sleep(0.1)  # no descriptor to accept with: wait, rather than spin on the listener
            raise

    def _reap(self) -> None:
        """Close the connections past their deadline: a blocked read then returns at once."""
        while not self._stopping.wait(min(0.25, self.request_deadline_s / 4)):
            now = time.monotonic()
            with self._lock:
                late = [c for c, d in self._deadlines.items() if d < now]
            for conn in late:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def handle_error(self, request, client_address) -> None:
        """A client that went away or overstayed is routine; anything else is one line, not a traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError, OSError)):
            return
        self.on_error()

    # -- life -----------------------------------------------------------------------------

    def start(self) -> MetricsServer:
        # A short poll interval so close() returns quickly at the end of training.
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1},
                                       name="diag-exporter", daemon=True)
        self.thread.start()
        self._reaper = threading.Thread(target=self._reap, name="diag-exporter-reaper", daemon=True)
        self._reaper.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self.shutdown()
        self.server_close()
        if self.thread is not None:
            self.thread.join(timeout=2.0)
        if self._reaper is not None:
            self._reaper.join(timeout=2.0)

    @property
    def port(self) -> int:
        return self.server_address[1]
