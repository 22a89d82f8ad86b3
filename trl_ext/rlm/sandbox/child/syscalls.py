"""Inside the sandbox: the Linux system calls Python lacks, through ctypes (loaded on first use), and their
constants (x86_64 and aarch64 share these).
"""

import os

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
