"""The sandbox side of the REPL: the zygote, each REPL's supervisor and its server (this code runs outside the
trainer's process).

The parent (`trl_ext.rlm.sandbox`) never imports this module. It compiles its source once, starts one zygote per
trainer process with ``python -I -S -B -c <boot stub> <read fd> <socket fd>`` and sends it the compiled code
(marshal), which the stub executes. So everything here is standard library only (plus ctypes for the system
calls Python 3.10 lacks) and must not import `trl_ext` (the sandbox cannot see the project's source tree).

Life of one REPL (docs/security.md explains why each step is there):
0. the zygote receives the REPL's configuration and pipes over its socket and forks; the child takes the REPL's
   session, environment, log and directory (`_zygote`, `_become_repl`);
1. it becomes the supervisor: subreaper, lifeline to the trainer, new PID namespace (namespace backend); it forks
   the server (PID 1 there) and stays behind to reap, kill and report (`_supervise`);
2. the server joins its control groups, enters mount, IPC, UTS (and network) namespaces and pivots into a root
   file system that shows only the runtime (`_enter_namespaces`); the process backend instead opens an
   ``O_PATH`` descriptor on every import directory while still privileged;
3. it applies its rlimits and ``no_new_privs``, drops to its private uid (or clears its capabilities in a user
   namespace), installs the seccomp filter, kills anything left over under its uid, and points the import
   system at ``/proc/self/fd/<n>`` for directories the uid cannot traverse (process backend);
4. it receives the init payload (``context``, helper source, helper objects), runs the helpers, reports ready;
5. it serves cells until told to close or until the parent's end of the pipe closes.

Wire protocol (both directions): a 4-byte big-endian length, then the payload. Parent -> child payloads are
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


# ------------------------------------------------------------------------------------- operating-system setup
# Linux constants (x86_64 and aarch64 share these).
_PR_SET_DUMPABLE = 4
_PR_SET_SECCOMP = 22
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_MODE_FILTER = 2
_CLONE_NEWNS = 0x00020000
_CLONE_NEWCGROUP = 0x02000000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MNT_DETACH = 2
_NAMESPACE_UID = 1000  # the sandbox's uid inside its user namespace (non-root trainers)
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
_libc = None


def _c():
    """libc through ctypes, loaded on first use (ctypes is the only non-C-module import of the server)."""
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(result, what):
    if result != 0:
        import ctypes

        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _prctl(option, value, what):
    _check(_c().prctl(option, value, 0, 0, 0), what)


def _write_file(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _supervise(config, protocol_fds):
    """Fork the server and stay behind as its supervisor; returns only in the server (the child).

    The supervisor runs no model code and keeps its privileges. It adopts every orphan of the sandbox
    (``PR_SET_CHILD_SUBREAPER``) and reaps it, so zombies never pile up against the uid's process limit. It
    reads the lifeline, a pipe whose other end only the trainer holds: end of file, because the trainer closed
    it or died however it died, makes it kill everything of the sandbox, wait until nothing is left and exit
    with the server's status (re-raising its signal). A trainer that closes an interpreter writes a byte first;
    end of file without it means the trainer is gone, and the supervisor also removes the REPL's control groups
    and directory, so a trainer killed with SIGKILL leaves nothing behind.
    """
    lifeline = config["lifeline_fd"]
    _prctl(_PR_SET_CHILD_SUBREAPER, 1, "prctl(PR_SET_CHILD_SUBREAPER)")
    if config["namespace"]:  # the server becomes PID 1 of a new PID namespace: when it dies, all of it dies
        if config["user_namespace"]:  # unprivileged trainer: be root in a user namespace mapped to its uid
            uid, gid = os.getuid(), os.getgid()
            _check(_c().unshare(_CLONE_NEWUSER | _CLONE_NEWPID), "unshare(CLONE_NEWUSER | CLONE_NEWPID)")
            _write_file("/proc/self/setgroups", "deny")
            _write_file("/proc/self/uid_map", f"{_NAMESPACE_UID} {uid} 1")  # not 0: model code is no root
            _write_file("/proc/self/gid_map", f"{_NAMESPACE_UID} {gid} 1")
        else:
            _check(_c().unshare(_CLONE_NEWPID), "unshare(CLONE_NEWPID)")
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    _signal.set_wakeup_fd(wake_write)
    _signal.signal(_signal.SIGCHLD, lambda *_: None)
    server = os.fork()
    if server == 0:
        _signal.set_wakeup_fd(-1)
        _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
        for fd in (lifeline, wake_read, wake_write, config["status_fd"]):  # model code must not write a status
            os.close(fd)
        return
    for fd in protocol_fds:
        os.close(fd)
    import select

    status = None
    killing = False
    released = False  # the trainer said it is closing this interpreter (a byte before the end of file)
    trainer_gone = False  # end of file without that byte
    while True:
        while True:  # reap the server and every adopted orphan
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = -1
            if pid <= 0:
                break
            if pid == server:
                status = wait_status
        if status is not None and not killing:
            killing = True  # the server is gone: nothing else of the sandbox may stay
            _kill_sandbox(config, server)
        if killing:
            try:
                os.waitpid(-1, 0)  # block until every remaining child is reaped
                continue
            except ChildProcessError:
                break
        readable, _, _ = select.select([lifeline, wake_read], [], [])
        if wake_read in readable:
            try:
                while os.read(wake_read, 512):
                    pass
            except BlockingIOError:
                pass
        if lifeline in readable:
            try:
                data = os.read(lifeline, 64)
            except OSError:
                data = b""
            released = released or bool(data)
            trainer_gone = not data and not released
            if not data and not killing:
                killing = True
                _kill_sandbox(config, server)
            if not data:
                os.close(lifeline)
                lifeline = wake_read  # nothing more to read there
    if trainer_gone:  # end of file without the trainer's word: it died however it died; clean up after it
        for path in config["cgroups"].values():
            try:
                os.rmdir(path)
            except OSError:
                pass
        import shutil

        shutil.rmtree(config["root_dir"], ignore_errors=True)
    # The server's wait status for the trainer, which is not this process's parent (the zygote is).
    os.write(config["status_fd"], (status if status is not None else 1 << 8).to_bytes(4, "big"))
    os._exit(0)


def _kill_sandbox(config, server):
    """SIGKILL every process of the sandbox: its PID namespace, its control groups and its private uid."""
    if "freezer" in config["cgroups"]:  # a frozen task dies only once thawed
        try:
            _write_file(os.path.join(config["cgroups"]["freezer"], "freezer.state"), "THAWED")
        except OSError:
            pass
    try:
        os.kill(server, _signal.SIGKILL)  # with a PID namespace this kills every process in it
    except ProcessLookupError:
        pass
    for _ in range(100):
        pids = set()
        for path in config["cgroups"].values():
            try:
                with open(os.path.join(path, "cgroup.procs")) as handle:
                    pids.update(int(line) for line in handle if line.strip())
            except OSError:
                pass
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, _signal.SIGKILL)
            except ProcessLookupError:
                pass
    uid = config["uid"]
    if uid is not None and not config["cgroups"] and not config["namespace"]:
        # kill(-1) as the private uid reaches exactly that uid's processes
        helper = os.fork()
        if helper == 0:
            try:
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                os.kill(-1, _signal.SIGKILL)
            except OSError:
                pass
            os._exit(0)


def _join_cgroups(paths):
    for path in paths:
        _write_file(os.path.join(path, "cgroup.procs"), "0")


def _enter_namespaces(config):
    """New mount, IPC, UTS (and network) namespaces with a root file system that shows only the runtime."""
    flags = _CLONE_NEWNS | _CLONE_NEWIPC | _CLONE_NEWUTS | (0 if config["network"] else _CLONE_NEWNET)
    _check(_c().unshare(flags), "unshare")
    mount = _c().mount
    _check(mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    root = config["rootfs"]
    options = f"size={config['disk_mb']}m,nr_inodes={max(1024, config['disk_mb'] * 64)},mode=0755"
    _check(mount(b"tmpfs", root.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options.encode()), "mount tmpfs")

    def inside(path):
        return os.path.join(root, path.lstrip("/"))

    def bind(source, writable=False):
        target = inside(source)
        if os.path.isdir(source):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        _check(mount(source.encode(), target.encode(), None, _MS_BIND | _MS_REC, None), f"bind {source}")
        if not writable:
            flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID
            _check(mount(None, target.encode(), None, flags | _MS_NODEV, None), f"read-only {source}")

    for path in config["bind_paths"]:
        if os.path.islink(path) and os.path.dirname(path) == "/":  # /bin -> usr/bin on merged-/usr systems
            os.symlink(os.readlink(path), inside(path))
        elif os.path.exists(path):
            bind(path)
    for name in ("null", "zero", "full", "random", "urandom"):
        bind(f"/dev/{name}", writable=True)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, inside(f"/dev/{name}"))
    for path in ("/tmp", "/dev/shm"):
        os.makedirs(inside(path), exist_ok=True)
        os.chmod(inside(path), 0o1777)
    home = inside(config["home"])
    os.makedirs(home, exist_ok=True)
    os.makedirs(inside("/proc"), exist_ok=True)
    if config["uid"] is not None:
        os.chown(home, config["uid"], config["gid"])
    os.chmod(home, 0o700)
    # This process is PID 1 of the new PID namespace, so this /proc shows only the sandbox. It is mounted while the
    # host's /proc is still in view: inside a user namespace the kernel allows a proc mount only then.
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    _check(mount(b"proc", inside("/proc").encode(), b"proc", flags, None), "mount /proc")
    os.chdir(root)
    _check(_c().syscall(_SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _check(_c().umount2(b".", _MNT_DETACH), "detach the old root")
    os.chdir("/")


def _drop_capabilities():
    """Clear every capability (the root of a user namespace has them all inside it)."""
    import ctypes

    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    _check(_c().syscall(_SYS_CAPSET[os.uname().machine], header, data), "capset")


# Seccomp: a classic BPF program, built here (no libseccomp binding is needed). It answers EPERM to the system calls
# an unprivileged sandbox has no use for and an escape would: new namespaces, mounts, tracing other processes,
# the kernel keyring, loading programs into the kernel. Only for x86_64 (the numbers below are its own); every
# system call of another ABI (i386 through int 0x80, x32) is refused outright.
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000
_DENIED_SYSCALLS_X86_64 = {
    "ptrace": 101,
    "syslog": 103,
    "vhangup": 153,
    "pivot_root": 155,
    "adjtimex": 159,
    "chroot": 161,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "iopl": 172,
    "ioperm": 173,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "lookup_dcookie": 212,
    "clock_settime": 227,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "mount_setattr": 442,
}
_SYS_CLONE_X86_64, _SYS_CLONE3_X86_64 = 56, 435
_CLONE_NAMESPACE_FLAGS = (
    _CLONE_NEWNS | _CLONE_NEWCGROUP | _CLONE_NEWUTS | _CLONE_NEWIPC | _CLONE_NEWUSER | _CLONE_NEWPID | _CLONE_NEWNET
)


def _seccomp_program():
    """The filter as bytes of ``struct sock_filter`` (x86_64)."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ..., BPF_RET|K
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    # (code, true target, false target, k); targets are labels resolved below, None = next instruction.
    program = [
        (ld, None, None, 4),  # seccomp_data.arch
        (jeq, None, "deny", _AUDIT_ARCH_X86_64),
        (ld, None, None, 0),  # seccomp_data.nr
        (jge, "deny", None, _X32_SYSCALL_BIT),
        (jeq, "nosys", None, _SYS_CLONE3_X86_64),  # clone3 hides its flags in memory: libc falls back to clone
        (jeq, "clone", None, _SYS_CLONE_X86_64),
        *((jeq, "deny", None, number) for number in sorted(_DENIED_SYSCALLS_X86_64.values())),
        (ret, None, None, allow),
        ("clone", ld, None, None, 16),  # seccomp_data.args[0], low 32 bits: the clone flags
        (jset, "deny", None, _CLONE_NAMESPACE_FLAGS),
        (ret, None, None, allow),
        ("nosys", ret, None, None, enosys),
        ("deny", ret, None, None, eperm),
    ]
    labels, rows = {}, []
    for row in program:
        if isinstance(row[0], str):
            labels[row[0]] = len(rows)
            row = row[1:]
        rows.append(row)
    data = b""
    for index, (code, true, false, k) in enumerate(rows):
        jt = 0 if true is None else labels[true] - index - 1
        jf = 0 if false is None else labels[false] - index - 1
        data += _struct.pack("=HBBI", code, jt, jf, k)
    return data


def _install_seccomp():
    import ctypes

    program = _seccomp_program()
    buffer = ctypes.create_string_buffer(program, len(program))

    class _Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = _Program(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _check(_c().prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp filter")


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


def _zygote(config):
    """Serve the trainer's requests for new REPLs: fork one per request; returns only in a forked child.

    Starting an interpreter costs tens of milliseconds of CPU; forking this one, which has the server loaded and
    ctypes imported, costs about one. A request is the REPL's configuration (a pickle: the trainer is trusted)
    with its descriptors attached (``SCM_RIGHTS``); the reply is the new supervisor's pid. The zygote runs no
    model code and exits when its lifeline reaches end of file (the trainer closed it or died).
    """
    import array
    import select
    import socket

    requests = socket.socket(fileno=config["socket_fd"])
    lifeline = config["lifeline_fd"]
    _signal.signal(_signal.SIGCHLD, _signal.SIG_IGN)  # the kernel reaps the supervisors
    _c()  # ctypes, imported once here rather than in every REPL
    poller = select.poll()
    poller.register(requests.fileno(), select.POLLIN)
    poller.register(lifeline, select.POLLIN)
    while True:
        events = dict(poller.poll())
        if lifeline in events:
            os._exit(0)
        fds = array.array("i")
        message, ancillary, _, _ = requests.recvmsg(1 << 20, socket.CMSG_SPACE(8 * fds.itemsize))
        if not message:
            os._exit(0)
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        request = _pickle.loads(message)
        child = os.fork()
        if child == 0:
            _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
            requests.close()
            os.close(lifeline)
            return request, list(fds)
        for fd in fds:
            os.close(fd)
        requests.sendall(child.to_bytes(4, "big"))


def _become_repl(request, fds):
    """In a child of the zygote: take the REPL's descriptors, session, environment and directory."""
    read_fd, write_fd, lifeline, status, log = fds
    os.setsid()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    config = request["config"]
    config.update(lifeline_fd=lifeline, status_fd=status)
    for fd in (read_fd, write_fd, lifeline, status):
        os.set_inheritable(fd, False)
    return config, read_fd, write_fd


def main():
    read_fd, write_fd = int(sys.argv[1]), int(sys.argv[2])
    config = _Channel(read_fd, write_fd).recv()
    if config.get("zygote"):
        config, read_fd, write_fd = _become_repl(*_zygote(config))
    channel = _Channel(read_fd, write_fd)
    if config["lifeline_fd"] is not None:
        _supervise(config, (read_fd, write_fd))  # returns in the server, a child of the supervisor
    _join_cgroups(config["cgroups"].values())
    if config["namespace"]:
        _enter_namespaces(config)
        opened = []  # the runtime is mounted where every uid can read it
    else:
        opened = _open_import_dirs(config["import_paths"])
    _apply_limits(config["limits"])
    _prctl(_PR_SET_NO_NEW_PRIVS, 1, "prctl(PR_SET_NO_NEW_PRIVS)")  # setuid binaries no longer raise privileges
    if config["uid"] is not None:
        _drop_privileges(config["uid"], config["gid"])
    elif config["namespace"] and config["user_namespace"]:
        _drop_capabilities()
    if config["seccomp"]:
        _install_seccomp()
    os.umask(0o077)
    os.chdir(config["home"])
    if config["reap_strays"]:
        _reap_strays()  # leftovers of an earlier session that used the same private uid
    if config["namespace"]:
        sys.path[:] = config["import_paths"]
    else:
        _rewrite_import_paths(opened)

    protocol_fds = (read_fd, write_fd)

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
