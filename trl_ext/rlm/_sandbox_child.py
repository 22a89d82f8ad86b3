"""The server half of the sandboxed REPL: this code runs *inside* the sandbox subprocess.

The parent (`trl_ext.rlm.repl.PythonREPL`) never imports this module. It compiles its source once, starts
``python -I -S -B -c <boot stub> <read fd> <write fd>`` and sends the compiled code (marshal) as the first
message, which the stub executes. So everything here is standard library only and must not import `trl_ext`
(the sandbox cannot see the project's source tree). It starts once per rollout: it imports only C modules
(``_pickle``, ``_json``, ``_ast``...), which keeps the interpreter's start near its floor.

Startup, in order:
0. read the configuration (the first message on the pipe);
1. open an ``O_PATH`` descriptor on every import directory of the interpreter (stdlib, lib-dynload,
   site-packages) while still privileged;
2. apply the resource limits (address space, CPU time, processes, file size, open files);
3. when the parent runs as root, drop to the REPL's private unprivileged uid/gid and kill anything left over
   under that uid from an earlier session (``kill(-1)`` as that uid reaches only that uid's processes);
4. point the import system at ``/proc/self/fd/<n>`` for directories the new uid cannot traverse (e.g. a
   Python installed under ``/root``), so ``import re`` keeps working without exposing anything else;
5. receive the init payload (``context``, helper source, helper objects), run the helpers, report ready;
6. serve cells until told to close or until the parent's end of the pipe closes.

Wire protocol (both directions, after the code): a 4-byte big-endian length, then the payload. Parent -> child payloads are
pickles (the parent is trusted); child -> parent payloads are UTF-8 JSON objects, so the parent never
unpickles anything produced by model-written code.
"""

import _ast
import _json
import _pickle
import _signal
import _struct
import _thread
import builtins
import os
import resource
import sys

_HEADER = _struct.Struct(">I")
_ONLY_AST = 0x400  # ast.PyCF_ONLY_AST, without importing `ast` (slow to import; this code starts per rollout)
_SOURCES = {}  # filename -> source of every cell and helper, for tracebacks
_PATH_ALIASES = {}  # "/proc/self/fd/<n>" -> the import directory it stands for, for tracebacks
_QUERY_FUNCTIONS = ("llm_query", "llm_query_batched", "rlm_query", "rlm_query_batched")
_RESERVED = frozenset((*_QUERY_FUNCTIONS, "context", "SHOW_VARS", "FINAL_VAR"))


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


class _BoundedWriter:
    """A text stream that keeps the first `limit` characters written to it and counts the rest."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, limit):
        self.limit = limit
        self.parts = []
        self.kept = 0
        self.dropped = 0

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        room = self.limit - self.kept
        if room > 0:
            self.parts.append(text[:room])
            self.kept += min(room, len(text))
        self.dropped += max(0, len(text) - max(room, 0))
        return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        pass

    def isatty(self):
        return False

    def readable(self):
        return False

    def writable(self):
        return True

    def getvalue(self):
        text = "".join(self.parts)
        if self.dropped:
            text += f"\n... [{self.dropped} more characters of output not shown]"
        return text


class _Server:
    def __init__(self, channel, config, init):
        self.channel = channel
        self.max_output_chars = config["max_output_chars"]
        self.reap_strays = config["reap_strays"]
        self.main_pid = os.getpid()
        self.main_thread = _thread.get_ident()
        self.cell = 0
        self.in_cell = False
        self.final_answer = None
        self.namespace = {"__name__": "__main__", "__builtins__": builtins, "context": init["context"]}
        self.namespace.update(
            llm_query=self.llm_query,
            llm_query_batched=self.llm_query_batched,
            rlm_query=self.rlm_query,
            rlm_query_batched=self.rlm_query_batched,
            SHOW_VARS=self.show_vars,
            FINAL_VAR=self.final_var,
        )
        before = set(self.namespace)
        self.namespace.update(init["objects"])
        for index, source in enumerate(init["helpers"]):
            filename = f"<helper-{index}>"
            _SOURCES[filename] = source
            exec(compile(source, filename, "exec"), self.namespace)
        self.helper_names = set(self.namespace) - before

    # ----------------------------------------------------------------------------------------- REPL functions
    def _query(self, function, prompts, contexts):
        if not self.in_cell or os.getpid() != self.main_pid or _thread.get_ident() != self.main_thread:
            raise RuntimeError(
                f"{function} can only be called from the cell's own code (main thread, while the cell runs); "
                "use the *_batched functions for concurrent queries"
            )
        self.channel.send({"kind": "query", "function": function, "prompts": prompts, "contexts": contexts})
        reply = self.channel.recv()
        if reply.get("error") is not None:
            raise RuntimeError(f"{function} failed: {reply['error']}")
        return reply["answers"]

    @staticmethod
    def _check_prompts(function, prompts):
        if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
            raise TypeError(f"{function} expects a list of prompt strings, got {type(prompts).__name__}")
        for index, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                raise TypeError(f"{function}: prompts[{index}] must be a str, got {type(prompt).__name__}")
        return list(prompts)

    @staticmethod
    def _check_context(function, context):
        try:
            _to_json(context)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{function}: a child's context must be JSON-serialisable (str, list, dict, numbers); {exc}"
            ) from None
        return context

    def llm_query(self, prompt):
        """One plain completion from the policy for `prompt`; returns its text."""
        if not isinstance(prompt, str):
            raise TypeError(f"llm_query expects a prompt string, got {type(prompt).__name__}")
        return self._query("llm_query", [prompt], None)[0]

    def llm_query_batched(self, prompts):
        """Plain completions for several prompts, generated concurrently; returns their texts in order."""
        prompts = self._check_prompts("llm_query_batched", prompts)
        return self._query("llm_query_batched", prompts, None) if prompts else []

    def rlm_query(self, prompt, context=None):
        """Runs a child RLM (its own REPL, same policy) on `prompt`; returns its final answer."""
        if not isinstance(prompt, str):
            raise TypeError(f"rlm_query expects a prompt string, got {type(prompt).__name__}")
        return self._query("rlm_query", [prompt], [self._check_context("rlm_query", context)])[0]

    def rlm_query_batched(self, prompts, context_list=None):
        """Runs one child RLM per prompt concurrently; returns their final answers in order."""
        prompts = self._check_prompts("rlm_query_batched", prompts)
        if context_list is None:
            contexts = [None] * len(prompts)
        else:
            contexts = list(context_list)
            if len(contexts) != len(prompts):
                raise ValueError(
                    f"rlm_query_batched got {len(prompts)} prompts but {len(contexts)} contexts; pass one context "
                    "per prompt or context_list=None"
                )
            contexts = [self._check_context("rlm_query_batched", context) for context in contexts]
        return self._query("rlm_query_batched", prompts, contexts) if prompts else []

    def show_vars(self):
        """The variables created so far, as {name: type name} (REPL functions, helpers and modules excluded)."""
        return {
            name: type(value).__name__
            for name, value in self.namespace.items()
            if not name.startswith("_")
            and name not in self.helper_names
            and name not in _RESERVED - {"context"}
            and not isinstance(value, type(builtins))  # imported modules are not variables
        }

    def final_var(self, name):
        """Marks the variable called `name` (or, given a non-string, that value) as the final answer."""
        if isinstance(name, str):
            key = name.strip().strip("'\"")
            if key not in self.namespace or key.startswith("__"):
                raise NameError(
                    f"FINAL_VAR({name!r}): no variable named {key!r}. Create it in a ```repl block first; "
                    f"variables: {sorted(self.show_vars())}"
                )
            value = self.namespace[key]
        else:
            value = name
        self.final_answer = value if isinstance(value, str) else str(value)

    # ----------------------------------------------------------------------------------------------- cells
    def run_cell(self, code):
        self.cell += 1
        filename = f"<repl-{self.cell}>"
        _SOURCES[filename] = code
        self.final_answer = None
        capture = _BoundedWriter(self.max_output_chars)
        try:
            fd_start = os.fstat(1).st_size
        except OSError:
            fd_start = 0
        saved = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = capture
        self.in_cell = True
        error = None
        try:
            tree = compile(code, filename, "exec", _ONLY_AST)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], _ast.Expr) else None
            exec(compile(tree, filename, "exec"), self.namespace)
            if last is not None:  # like the interactive interpreter: show the value of a trailing expression
                value = eval(compile(_ast.Expression(last.value), filename, "eval"), self.namespace)
                if value is not None:
                    capture.write(repr(value) + "\n")
        except BaseException as exc:  # noqa: B902 - SystemExit/KeyboardInterrupt from model code are errors too
            if os.getpid() != self.main_pid:  # a fork of the REPL that fell out of model code: vanish quietly
                os._exit(1)
            error = _format_exception(exc, self.max_output_chars)
        finally:
            self.in_cell = False
            sys.stdout, sys.stderr = saved
        if os.getpid() != self.main_pid:
            os._exit(0)
        if self.reap_strays:
            _reap_strays()
        stdout = capture.getvalue() + _fd_output(fd_start, self.max_output_chars)
        return {"kind": "result", "stdout": stdout, "error": error, "final_answer": self.final_answer}

    def serve(self):
        self.channel.send({"kind": "ready", "pid": os.getpid()})
        while True:
            message = self.channel.recv()
            kind = message.get("kind")
            if kind == "exec":
                self.channel.send(self.run_cell(message["code"]))
            elif kind == "close":
                if self.reap_strays:
                    _reap_strays()
                os._exit(0)


def _format_exception(exc, limit, first_frame="<repl-"):
    import linecache  # imported lazily: most cells never raise
    import traceback

    for filename, source in _SOURCES.items():
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)

    frames = traceback.extract_tb(exc.__traceback__)
    # Keep only the model's own frames (and what they called), not this server's.
    while frames and not frames[0].filename.startswith(first_frame):
        frames.pop(0)
    frames = [frame for frame in frames if frame.filename not in ("<sandbox>", "<string>")]  # this server's frames
    for frame in frames:
        for alias, path in _PATH_ALIASES.items():
            if frame.filename.startswith(alias + os.sep):
                frame.filename = path + frame.filename[len(alias) :]
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)] if frames else []
    lines += traceback.format_exception_only(type(exc), exc)
    text = "".join(lines)
    if len(text) > limit:
        text = (
            text[: limit // 2]
            + f"\n... [{len(text) - limit} characters of traceback not shown] ...\n"
            + text[-limit // 2 :]
        )
    return text


def _fd_output(start, limit):
    """Output written straight to file descriptors 1/2 (e.g. by a subprocess) during the cell."""
    try:
        end = os.fstat(1).st_size
        if end <= start:
            return ""
        data = os.pread(1, min(end - start, limit), start)
    except OSError:  # model code closed or replaced descriptor 1
        return ""
    text = data.decode("utf-8", "replace")
    if end - start > limit:
        text += f"\n... [{end - start - limit} more bytes of output not shown]"
    return text


def _reap_strays():
    """Kill every other process of this sandbox (same private uid, or same PID namespace) and reap them."""
    try:
        os.kill(-1, _signal.SIGKILL)  # never signals the caller itself
    except (ProcessLookupError, PermissionError):
        pass
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _open_import_dirs(paths):
    opened = []
    for path in paths:
        try:
            opened.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
        except OSError:
            continue
    return opened


def _apply_limits(limits):
    for name, value in limits.items():
        if value is not None:
            resource.setrlimit(getattr(resource, name), (value, value))


def _drop_privileges(uid, gid):
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise RuntimeError("privilege drop failed")


def _rewrite_import_paths(opened):
    """Use /proc/self/fd/<n> for import directories the (new) uid cannot traverse by name."""
    mapping = {}
    for path, fd in opened:
        if os.access(path, os.R_OK | os.X_OK):
            os.close(fd)
        else:
            mapping[path] = f"/proc/self/fd/{fd}"
            _PATH_ALIASES[mapping[path]] = path

    def remap(entry):
        for path, replacement in mapping.items():
            if entry == path or entry.startswith(path + os.sep):
                return replacement + entry[len(path) :]
        return entry

    sys.path[:] = [remap(path) for path, _ in opened]
    for module in list(sys.modules.values()):
        package_path = getattr(module, "__path__", None)
        if isinstance(package_path, list):
            package_path[:] = [remap(entry) for entry in package_path]
    sys.path_importer_cache.clear()


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


def main():
    channel = _Channel(int(sys.argv[1]), int(sys.argv[2]))
    config = channel.recv()
    opened = _open_import_dirs(config["import_paths"])
    _apply_limits(config["limits"])
    if config["uid"] is not None:
        _drop_privileges(config["uid"], config["gid"])
    if config["reap_strays"]:
        _reap_strays()  # leftovers of an earlier session that used the same private uid
    _rewrite_import_paths(opened)

    protocol_fds = (config["read_fd"], config["write_fd"])

    def _close_protocol_fds():  # forks of the REPL must not be able to talk to the parent
        for fd in protocol_fds:
            try:
                os.close(fd)
            except OSError:
                pass

    os.register_at_fork(after_in_child=_close_protocol_fds)
    try:
        server = _Server(channel, config, channel.recv())
    except BaseException as exc:  # noqa: B902 - report a context or helper that fails to load to the parent
        channel.send({"kind": "ready", "error": _format_exception(exc, 20_000, first_frame="<helper-")})
        os._exit(1)
    server.serve()


if __name__ == "__main__":
    main()
