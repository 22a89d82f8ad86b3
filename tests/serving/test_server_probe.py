"""`probe_server`: why a server cannot be reached, against real sockets and a real `http.server` on 127.0.0.1."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from trl_ext.serving import server_probe
from trl_ext.serving.server_probe import FAIL_FAST_PREFIXES, probe_server


class HealthHandler(http.server.BaseHTTPRequestHandler):
    status = 200  # what /health answers (set per server)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture
def health_server() -> Iterator[Callable[[int], str]]:
    servers = []

    def start(status: int) -> str:
        handler = type("Handler", (HealthHandler,), {"status": status})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_healthy_server_gives_none(health_server):
    url = health_server(200)
    assert probe_server(url, 5.0) is None
    assert probe_server(url + "/", 5.0) is None  # a trailing / is ignored


def test_an_unhealthy_server_is_named_with_its_status(health_server):
    url = health_server(500)
    reason = probe_server(url, 5.0)
    assert reason.startswith(f"HTTP 500 from {url}/health: a server answers there but is not healthy"), reason


def test_a_closed_port_is_connection_refused_at_once():
    port = closed_port()
    start = time.monotonic()
    reason = probe_server(f"http://127.0.0.1:{port}", 5.0)
    assert time.monotonic() - start < 2.0  # no waiting for the timeout
    assert reason.startswith(f"connection refused: nothing listens on 127.0.0.1:{port}"), reason
    assert reason.startswith(FAIL_FAST_PREFIXES)  # waiting cannot help
    assert probe_server(f"http://localhost:{port}", 5.0).startswith(FAIL_FAST_PREFIXES)


def test_a_port_bound_but_not_listening_yet_is_a_server_starting():
    """`vllm serve` binds its port (SO_REUSEADDR, SO_REUSEPORT) before loading the model and listens only once it is
    loaded: connections are refused meanwhile, but the port is held, so the probe says the server is starting."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("0.0.0.0", 0))  # as `vllm serve --host 0.0.0.0`
        port = sock.getsockname()[1]
        reason = probe_server(f"http://127.0.0.1:{port}", 5.0)
        assert reason.startswith(f"not listening yet: 127.0.0.1:{port} refuses connections, but a process"), reason
        assert not reason.startswith(FAIL_FAST_PREFIXES)
        sock.listen(8)  # the model is loaded: the port listens, and the probe freed it again
        assert probe_server(f"http://127.0.0.1:{port}", 0.3).startswith("timeout:")


def test_another_machine_refusing_cannot_be_told_from_one_still_loading():
    reason = server_probe._describe(ConnectionRefusedError(), "http://gpu-node:8000", 5.0)
    assert reason.startswith("connection refused by gpu-node:8000: nothing listens there, or a `vllm serve`"), reason
    assert not reason.startswith(FAIL_FAST_PREFIXES)
    assert server_probe._describe(socket.gaierror(-2, "Name or service not known"), "http://gpu-nod:8000", 5.0) == (
        "unknown host: gpu-nod does not resolve ([Errno -2] Name or service not known)"
    )


def test_a_server_that_accepts_but_never_answers_is_a_timeout():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)  # the kernel accepts the connection; nobody reads the request
        port = sock.getsockname()[1]
        start = time.monotonic()
        reason = probe_server(f"http://127.0.0.1:{port}", 0.5)
        waited = time.monotonic() - start
    assert 0.4 < waited < 3.0, waited
    assert reason.startswith(f"timeout: no answer from 127.0.0.1:{port} within 0.5 s"), reason
    assert "may still be loading" in reason
