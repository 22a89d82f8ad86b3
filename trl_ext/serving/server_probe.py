"""`probe_server`: one ``GET {url}/health``, and in a few words why a server cannot be reached.

TRL's asynchronous trainer waits up to ``vllm_server_timeout`` seconds (240 by default) for ``vllm serve`` to answer
``/health``, whatever the failure. The failures differ, and the description starts with which one it is:

- ``"connection refused: nothing listens on HOST:PORT"``: on this machine (a loopback host), nothing holds the port:
  no server was started there, or it exited. Waiting cannot help (`FAIL_FAST_PREFIXES`).
- ``"not listening yet: HOST:PORT ..."``: on this machine, a process holds the port but does not accept connections
  yet. ``vllm serve`` binds its port before it loads the model and listens only once the model is loaded, so this is
  a server still starting: waiting can help.
- ``"connection refused by HOST:PORT"``: another machine refused. Nothing listens there, or a ``vllm serve`` is still
  loading its model (a client cannot tell the two apart from here).
- ``"timeout: ..."``: the connection was accepted (or not answered) but no answer came in time: a server busy or still
  starting, or a firewall that drops packets.
- ``"HTTP <status> from URL/health ..."``: a server answered, but not 200 (vLLM answers 503 when its engine is dead).
- ``"unknown host: ..."``: the host name does not resolve (`FAIL_FAST_PREFIXES`).
- ``"unreachable: ..."``: any other network error.

The probe uses `urllib.request`, so it goes through the same proxies (from the environment) as TRL's `requests`.
"""

from __future__ import annotations

import errno
import http.client
import ipaddress
import socket
import urllib.error
import urllib.request
from urllib.parse import urlsplit

__all__ = ["FAIL_FAST_PREFIXES", "probe_server"]

# Descriptions after which waiting for the server cannot help: nothing holds the port on this machine, or the host
# name does not resolve.
FAIL_FAST_PREFIXES = ("connection refused: nothing listens on", "unknown host:")


def probe_server(url: str, timeout_s: float = 5.0) -> str | None:
    """Ask ``GET {url}/health`` once, waiting at most ``timeout_s`` seconds to connect and again to read.

    Args:
        url: the server's base URL (``vllm_server_base_url``: ``http://127.0.0.1:8000``; a trailing ``/`` is
            ignored).
        timeout_s: seconds to wait for the connection, and for the answer.

    Returns:
        None when the server answers 200 (healthy); otherwise a short description of why it cannot be used, starting
        with the kind of failure (module docstring): ``"connection refused: nothing listens on 127.0.0.1:8000 (...)"``,
        ``"not listening yet: ..."``, ``"connection refused by host:8000 ..."``, ``"timeout: ..."``, ``"HTTP 500 from
        http://127.0.0.1:8000/health ..."``, ``"unknown host: ..."`` or ``"unreachable: ..."``. A description that
        starts with one of `FAIL_FAST_PREFIXES` will not change by waiting.
    """
    base = url.rstrip("/")
    health = f"{base}/health"
    try:
        with urllib.request.urlopen(health, timeout=timeout_s) as response:
            status = response.status
    except urllib.error.HTTPError as error:  # a server answered, with an error status
        reason = f" ({error.reason})" if error.reason else ""
        return f"HTTP {error.code} from {health}: a server answers there but is not healthy{reason}"
    except urllib.error.URLError as error:  # the connection failed: the cause is in `reason`
        return _describe(error.reason, base, timeout_s)
    except (OSError, http.client.HTTPException) as error:  # a timeout or a reset while reading the answer
        return _describe(error, base, timeout_s)
    if status != 200:
        return f"HTTP {status} from {health}: a server answers there but is not healthy (it answers 200 when it is)"
    return None


def _host_port(base: str) -> tuple[str, int]:
    """The host and port of ``base`` (the scheme's default port when it names none)."""
    parts = urlsplit(base)
    try:
        port = parts.port
    except ValueError:
        port = None
    return parts.hostname or parts.netloc, port or (443 if parts.scheme == "https" else 80)


def _describe(reason: object, base: str, timeout_s: float) -> str:
    """The failure ``reason`` (an exception, or urllib's reason string) in words."""
    host, port = _host_port(base)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if isinstance(reason, ConnectionRefusedError):
        held = _port_held(host, port)
        if held is False:
            return (
                f"connection refused: nothing listens on {address} (no server was started there, or it exited; "
                "nothing holds the port on this machine)"
            )
        if held is True:
            return (
                f"not listening yet: {address} refuses connections, but a process on this machine holds the port "
                "(a `vllm serve` binds it before loading the model and listens once the model is loaded)"
            )
        return (
            f"connection refused by {address}: nothing listens there, or a `vllm serve` there is still loading its "
            "model (it listens once the model is loaded)"
        )
    if isinstance(reason, TimeoutError) or "timed out" in str(reason):
        return (
            f"timeout: no answer from {address} within {timeout_s:g} s (a server may still be loading, or be busy, "
            "or a firewall drops the packets)"
        )
    if isinstance(reason, socket.gaierror):
        return f"unknown host: {host} does not resolve ({reason})"
    return f"unreachable: {address}: {reason}"


def _port_held(host: str, port: int) -> bool | None:
    """Whether a process on this machine holds ``port`` of the loopback ``host`` (bound, perhaps not listening):
    True or False, or None when that cannot be told (another machine's host, or a port this process may not bind).

    Binding the port for an instant is the test; the socket asks for no address reuse, so it fails on a port that
    another socket holds (vLLM's own socket sets SO_REUSEADDR and SO_REUSEPORT, which lets *it* share a port, not
    this probe). It is closed at once, never connected, so it leaves nothing behind."""
    try:
        address = ipaddress.ip_address("127.0.0.1" if host == "localhost" else host)
    except ValueError:
        return None  # a host name: another machine, as far as this probe knows
    if not address.is_loopback:
        return None
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(address), port))
    except OSError as error:
        return True if error.errno == errno.EADDRINUSE else None
    return False
