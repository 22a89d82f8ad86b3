"""Inside the sandbox: the life of one REPL, step by step (docs/security.md explains why each step is there).

0. the zygote receives the REPL's configuration and pipes over its socket and forks; the child takes the REPL's
   session, environment, log and directory (`_zygote`, `_become_repl`);
1. it becomes the supervisor: subreaper, lifeline to the trainer, new PID namespace (namespace backend); it forks
   the server (PID 1 there) and stays behind to reap, kill and report (`_supervise`);
2. the server joins its control groups, enters mount, IPC, UTS (and network) namespaces and pivots into a root
   file system that shows only the runtime (`_enter_namespaces`); the process backend instead opens an
   ``O_PATH`` descriptor on every import directory while still privileged, and where the host allows it takes
   SysV IPC and ptys of its own (`_private_ipc_and_ptys`);
3. it applies its rlimits and ``no_new_privs``, drops to its private uid (or clears its capabilities in a user
   namespace), installs the seccomp filter, kills anything left over under its uid, and points the import
   system at ``/proc/self/fd/<n>`` for directories the uid cannot traverse (process backend); its stdout and
   stderr leave the start-up log on the trainer's disk for an unlinked file in its own home (`_private_output`);
   the process backend then applies Landlock where the kernel has it (`_install_landlock`: files written only
   beneath its home, read only there and beneath the runtime's roots, no TCP, no signals or abstract sockets
   outside it);
4. it receives the init payload (``context``, helper source, helper objects), runs the helpers, reports ready;
5. it serves cells until told to close or until the parent's end of the pipe closes.
"""

import os
import sys

from .confine import (
    _apply_limits,
    _drop_capabilities,
    _drop_privileges,
    _enter_namespaces,
    _join_cgroups,
    _open_import_dirs,
    _rewrite_import_paths,
)
from .landlock import _install_landlock, _open_read_roots
from .seccomp import _install_seccomp
from .server import _format_exception, _private_output, _reap_strays, _Server
from .supervisor import _supervise
from .syscalls import (
    _CLONE_NEWIPC,
    _CLONE_NEWNS,
    _MS_BIND,
    _MS_NOEXEC,
    _MS_NOSUID,
    _MS_PRIVATE,
    _MS_REC,
    _PR_SET_NO_NEW_PRIVS,
    _c,
    _check,
    _prctl,
)
from .wire import _Channel
from .zygote import _become_repl, _zygote


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
        if config["private_ipc_and_ptys"]:
            _private_ipc_and_ptys()
    read_root_fds = _open_read_roots(config["read_roots"]) if config["landlock"] else []  # while privileged
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
    _private_output()  # from here on, output goes to the REPL's own disk, not to the log on the trainer's
    if config["reap_strays"]:
        _reap_strays()  # leftovers of an earlier session that used the same private uid
    if config["landlock"]:  # after the reaping: Landlock's signal scope would keep it from the leftovers
        _install_landlock(config["home"], config["network"], read_root_fds)
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


# The ptys a process-backend REPL may hold at once (its own devpts instance; the host's stay for the trainer).
_MAX_PTYS = 16


def _private_ipc_and_ptys():
    """The process backend where the host allows namespaces (a root trainer): new IPC and mount namespaces, so that
    its SysV shared memory, message queues and semaphores are its own (no channel to a concurrent REPL, nothing
    left behind: they die with the namespace), and a devpts instance of its own on /dev/pts capped at `_MAX_PTYS`
    ptys, so that it cannot take every pty of the host. The rest of the host's file system stays as it is."""
    _check(_c().unshare(_CLONE_NEWIPC | _CLONE_NEWNS), "unshare(CLONE_NEWIPC | CLONE_NEWNS)")
    mount = _c().mount
    _check(mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    options = f"newinstance,ptmxmode=0666,mode=0620,max={_MAX_PTYS}".encode()
    _check(mount(b"devpts", b"/dev/pts", b"devpts", _MS_NOSUID | _MS_NOEXEC, options), "mount a private /dev/pts")
    _check(mount(b"/dev/pts/ptmx", b"/dev/ptmx", None, _MS_BIND, None), "bind /dev/pts/ptmx on /dev/ptmx")


if __name__ == "__main__":
    main()
