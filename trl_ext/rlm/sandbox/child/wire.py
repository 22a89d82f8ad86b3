"""Inside the sandbox: the wire protocol's child side, blocking framed messages (pickles in from the trusted
parent, JSON out to it).

Threat model (docs/security.md, class 5): what the sandbox sends is JSON (ASCII, written here without importing
``json``), so the parent never unpickles anything model code produced.
"""

import _json
import _pickle
import _struct
import os

_HEADER = _struct.Struct(">I")


class _Channel:
    """Blocking framed messages: pickles in from the parent, JSON out to it."""

    def __init__(self, read_fd, write_fd):
        self.read_fd = read_fd
        self.write_fd = write_fd

    def _read_exact(self, size):
        chunks = []
        while size:
            chunk = os.read(self.read_fd, min(size, 1 << 20))
            if not chunk:  # the parent is gone: nothing left to serve
                os._exit(0)
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def recv(self):
        (size,) = _HEADER.unpack(self._read_exact(_HEADER.size))
        return _pickle.loads(self._read_exact(size))

    def send(self, message):
        payload = _to_json(message).encode("ascii")
        data = _HEADER.pack(len(payload)) + payload
        view = memoryview(data)
        while view:
            written = os.write(self.write_fd, view)
            view = view[written:]


def _to_json(value):
    """JSON text (ASCII: every non-ASCII character, lone surrogates included, escaped) without importing json."""
    if isinstance(value, str):
        return _json.encode_basestring_ascii(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{value!r} is not valid JSON")
        return float.__repr__(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_to_json(item) for item in value) + "]"
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"JSON object keys must be str, got {type(key).__name__}")
            items.append(_json.encode_basestring_ascii(key) + ":" + _to_json(item))
        return "{" + ",".join(items) + "}"
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")
