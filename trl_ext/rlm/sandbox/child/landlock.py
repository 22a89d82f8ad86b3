"""Inside the sandbox: Landlock for the process backend, which has no file system or network of its own
(docs/security.md, class 3). Unprivileged, stackable and kept across fork and exec: once applied, the REPL and
everything it starts may create, write, rename or remove files only beneath its home (plus writing the few device
files a program expects, /dev/null and the ptys), may not connect or bind a TCP socket unless its limits give it the
network (ABI 4), and may not reach abstract unix sockets or signal processes outside its own domain (ABI 6). Reading
is left to the file permissions (the interpreter, its libraries and /proc must stay readable).
"""

import os

from .syscalls import _c

_SYS_LANDLOCK_CREATE_RULESET = 444  # the same numbers on x86_64 and aarch64
_SYS_LANDLOCK_ADD_RULE = 445
_SYS_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1

_FS_WRITE_FILE = 1 << 1
_FS_WRITE_RIGHTS = {  # ABI -> the rights that change the file system, handled (denied unless a rule allows them)
    1: _FS_WRITE_FILE | sum(1 << bit for bit in (4, 5, 6, 7, 8, 9, 10, 11, 12)),  # remove, make dir/reg/sock/...
    2: 1 << 13,  # REFER: link or rename across directories
    3: 1 << 14,  # TRUNCATE
}
_FS_TRUNCATE = 1 << 14
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1
# Device files a program may open for writing; everything else beneath /dev (/dev/shm above all) stays closed.
_WRITABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/tty", "/dev/ptmx", "/dev/pts")


def _landlock_abi():
    """The kernel's Landlock ABI version, 0 when it has none (or it is disabled)."""
    result = _c().syscall(_SYS_LANDLOCK_CREATE_RULESET, None, 0, _LANDLOCK_CREATE_RULESET_VERSION)
    return max(int(result), 0)


def _install_landlock(home, network):
    """Restrict this process and its future children (module docstring); ``network``: the limits give model code
    the host's network, so TCP is not restricted. Needs ``no_new_privs``. Returns the ABI applied."""
    import ctypes
    import struct

    abi = _landlock_abi()
    if abi < 1:
        raise OSError("Landlock is not available in this kernel")
    write_rights = sum(rights for version, rights in _FS_WRITE_RIGHTS.items() if version <= abi)
    net = 0 if network or abi < 4 else _NET_BIND_TCP | _NET_CONNECT_TCP
    scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("=QQQ", write_rights, net, scoped)[: 8 if abi < 4 else (16 if abi < 6 else 24)]
    buffer = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _c().syscall(_SYS_LANDLOCK_CREATE_RULESET, buffer, len(attr), 0)
    if ruleset < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"landlock_create_ruleset: {os.strerror(errno)}")
    try:
        device_rights = _FS_WRITE_FILE | (_FS_TRUNCATE if abi >= 3 else 0)
        for path, rights in ((home, write_rights), *((device, device_rights) for device in _WRITABLE_DEVICES)):
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # a device this host lacks
            try:
                if not os.path.isdir(path):  # a file's rule may hold only the rights that apply to files
                    rights &= _FS_WRITE_FILE | _FS_TRUNCATE
                rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
                if _c().syscall(_SYS_LANDLOCK_ADD_RULE, ruleset, _LANDLOCK_RULE_PATH_BENEATH, rule, 0) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"landlock_add_rule({path}): {os.strerror(errno)}")
            finally:
                os.close(fd)
        if _c().syscall(_SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"landlock_restrict_self: {os.strerror(errno)}")
    finally:
        os.close(ruleset)
    return abi
