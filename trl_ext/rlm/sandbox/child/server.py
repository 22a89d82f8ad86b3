"""Inside the sandbox: the REPL server, the one process that runs model code: the namespace of ``context``, the
helpers and the query functions, cells with their captured output, tracebacks of the model's own frames.

Threat model (docs/security.md, classes 3 and 5): every cell carries the sequence number the parent sent, ends by
killing and reaping every other process of the sandbox (`_reap_strays`), and forks of the REPL cannot talk to the
parent.
"""

import _ast
import _signal
import _thread
import builtins
import os
import sys

from .confine import _PATH_ALIASES
from .wire import _to_json

_ONLY_AST = 0x400  # ast.PyCF_ONLY_AST, without importing `ast` (slow to import; this code starts per rollout)
_SOURCES = {}  # filename -> source of every cell and helper, for tracebacks
_QUERY_FUNCTIONS = ("llm_query", "llm_query_batched", "rlm_query", "rlm_query_batched")
_RESERVED = frozenset((*_QUERY_FUNCTIONS, "context", "SHOW_VARS", "FINAL_VAR"))


class _BoundedWriter:
    """A text stream that keeps the first `limit` characters written to it and counts them all (`written`)."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, limit):
        self.limit = limit
        self.parts = []
        self.kept = 0
        self.written = 0

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        room = self.limit - self.kept
        if room > 0:
            self.parts.append(text[:room])
            self.kept += min(room, len(text))
        self.written += len(text)
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
        """The characters kept (at most `limit`)."""
        return "".join(self.parts)


class _Server:
    def __init__(self, channel, config, init):
        self.channel = channel
        self.max_output_chars = config["max_output_chars"]
        self.max_answer_chars = config["max_answer_chars"]
        self.seq = 0
        self.reap_strays = config["reap_strays"]
        self.main_pid = os.getpid()
        self.main_thread = _thread.get_ident()
        self.cell = 0
        self.in_cell = False
        self.final_answer = None
        self.namespace = {"__name__": "__main__", "__builtins__": builtins, "context": init["context"]}
        self.namespace.update(
            {name: getattr(self, name) for name in _QUERY_FUNCTIONS},
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
        query = {"kind": "query", "seq": self.seq, "function": function, "prompts": prompts, "contexts": contexts}
        self.channel.send(query)
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
        fd_text, fd_size = _fd_output(self.max_output_chars)
        stdout = _cut_output(capture.getvalue() + fd_text, capture.written + fd_size, self.max_output_chars)
        answer = self.final_answer
        if answer is not None and len(answer) > self.max_answer_chars:  # the parent cuts it too (and records it)
            answer = answer[: self.max_answer_chars + 1]
        return {"kind": "result", "seq": self.seq, "stdout": stdout, "error": error, "final_answer": answer}

    def serve(self):
        self.channel.send({"kind": "ready", "pid": os.getpid()})
        while True:
            message = self.channel.recv()
            kind = message.get("kind")
            if kind == "exec":
                self.seq = message["seq"]
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


def _cut_output(text, size, limit):
    """A cell's output of `size` characters, of which `text` is the head: all of it when it fits in `limit`
    characters, else its first `limit` characters and a note counting the rest."""
    if size <= limit:
        return text
    return text[:limit] + f"\n... [{size - limit} more characters of output not shown]"


def _private_output():
    """Points descriptors 1 and 2 (the output of subprocesses and of C code) at an unlinked file in the REPL's
    home: it counts against the REPL's own disk (`disk_mb`: its tmpfs in the namespace backend) and dies with the
    REPL, where the log on the trainer's disk would grow with whatever model code writes. `_fd_output` empties it
    after every cell."""
    try:
        fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_APPEND, 0o600)
    except OSError:  # a file system without O_TMPFILE: a named file, unlinked at once
        name = f".output-{os.getpid()}-{os.urandom(8).hex()}"
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_APPEND, 0o600)
        os.unlink(name)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _fd_output(limit):
    """What was written straight to descriptors 1/2 (by a subprocess, by C code) during the cell: its first
    `limit` bytes as text and its size in bytes. Empties the file (`_private_output`) for the next cell."""
    try:
        size = os.fstat(1).st_size
        data = os.pread(1, min(size, limit), 0) if size else b""
        os.ftruncate(1, 0)
    except OSError:  # model code closed or replaced descriptor 1
        return "", 0
    return data.decode("utf-8", "replace"), size


def _reap_strays():
    """Kill every other process of this sandbox (same private uid, or same PID namespace) and reap them all.

    The wait blocks until no child is left: a killed process is reaped once it is gone, so no zombie of this cell
    stays behind to count against the next cell's process limit (as PID 1 of a namespace this server also adopts
    every orphan; without one, the supervisor adopts and reaps them).
    """
    try:
        os.kill(-1, _signal.SIGKILL)  # never signals the caller itself
    except (ProcessLookupError, PermissionError):
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
