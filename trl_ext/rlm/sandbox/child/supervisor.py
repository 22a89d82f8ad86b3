"""Inside the sandbox: the supervisor of one REPL, which runs no model code, reaps every orphan of the sandbox and
kills all of it when the server dies or the trainer closes its lifeline (or dies however it dies).

Threat model (docs/security.md, class 3): nothing of a REPL outlives it, not even when the trainer is killed with
SIGKILL (the supervisor then also removes the REPL's control groups and directory).
"""

import _signal
import os

from .syscalls import (
    _CLONE_NEWPID,
    _CLONE_NEWUSER,
    _NAMESPACE_UID,
    _PR_SET_CHILD_SUBREAPER,
    _c,
    _check,
    _prctl,
    _write_file,
)


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
        os.setpgid(0, 0)  # a process group of its own, which a trainer without control groups stops between cells
        _signal.set_wakeup_fd(-1)
        _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
        for fd in (lifeline, wake_read, wake_write, config["status_fd"]):  # model code must not write a status
            os.close(fd)
        return
    for fd in protocol_fds:
        os.close(fd)
    # the second report (the first is this process's pid, `_become_repl`): the server's pid, as the trainer's /proc
    # numbers it
    os.write(config["status_fd"], server.to_bytes(4, "big"))
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
    if config["uid"] is not None and not config["namespace"]:  # the process backend shares the host's SysV IPC
        _remove_sysv_ipc_of_uid(config["uid"])
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


def _remove_sysv_ipc_of_uid(uid):
    """Remove every SysV shared memory segment, message queue and semaphore set that `uid` created or owns.

    Without an IPC namespace of its own (the process backend on a host without namespaces) a REPL's SysV objects
    live in the host's: a shared memory segment would outlive the REPL, and its pages, charged to no group once the
    REPL's memory group is gone, would escape ``memory_mb`` across restarts. Run once every process of the sandbox
    is gone, as root (the private uid is the REPL's alone, so nothing else's objects are touched).
    """
    libc = _c()
    ipc_rmid = 0
    removers = {
        "shm": lambda ipc_id: libc.shmctl(ipc_id, ipc_rmid, None),
        "msg": lambda ipc_id: libc.msgctl(ipc_id, ipc_rmid, None),
        "sem": lambda ipc_id: libc.semctl(ipc_id, 0, ipc_rmid),
    }
    for kind, remove in removers.items():
        try:
            with open(f"/proc/sysvipc/{kind}") as handle:
                header, *rows = [line.split() for line in handle]
        except (OSError, ValueError):
            continue
        id_column, uid_column, cuid_column = 1, header.index("uid"), header.index("cuid")
        for row in rows:
            if uid in (int(row[uid_column]), int(row[cuid_column])):
                remove(int(row[id_column]))
