"""Inside the sandbox: the zygote, one pre-started interpreter per trainer process that forks a new REPL per
request, and the child's first step, taking the REPL's descriptors, session, environment and directory.

Threat model (docs/security.md, "How it is built"): the zygote runs no model code and exits when its lifeline
reaches end of file; a request comes from the trusted trainer only (a socket only the trainer holds).
"""

import _pickle
import _signal
import os

from .confine import _volunteer_as_oom_victim
from .syscalls import _c


def _zygote(config):
    """Serve the trainer's requests for new REPLs: fork one per request; returns only in a forked child.

    Starting an interpreter costs tens of milliseconds of CPU; forking this one, which has the server loaded and
    ctypes imported, costs about one. A request is the REPL's configuration (a pickle: the trainer is trusted)
    with its descriptors attached (``SCM_RIGHTS``). There is no reply: the child reports its own pid on the REPL's
    status pipe (`_become_repl`), so the trainer never waits for the zygote and requests follow one another without
    a round trip. The zygote runs no model code and exits when its lifeline reaches end of file (the trainer closed
    it or died).
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


def _become_repl(request, fds):
    """In a child of the zygote: report its pid on the status pipe (the first of the supervisor's reports), become
    the OOM killer's first choice (for every process of the REPL, supervisor included), and take the REPL's
    descriptors, session, environment and directory."""
    read_fd, write_fd, lifeline, status, log = fds
    os.write(status, os.getpid().to_bytes(4, "big"))
    _volunteer_as_oom_victim()
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
