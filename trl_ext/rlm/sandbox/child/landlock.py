"""Inside the sandbox: Landlock for the process backend, which has no file system or network of its own
(docs/security.md, class 3). Unprivileged, stackable and kept across fork and exec: once applied, the REPL and
everything it starts may create, write, rename or remove files only beneath its home (plus writing the few device
files a program expects, /dev/null and the ptys), may not connect or bind a TCP socket unless its limits give it the
network (ABI 4), and may not reach abstract unix sockets or signal processes outside its own domain (ABI 6). It may
read, list and execute only beneath its home and the roots the trainer computed (`trl_ext.rlm.sandbox.runtime.
readable_roots`: the system's directories, the Python installation, the interpreter's import directories), so not
the run's output_dir, the checkout, another REPL's home or anything else in /tmp and /var/tmp.
"""

import os

from .syscalls import _c

_SYS_LANDLOCK_CREATE_RULESET = 444  # the same numbers on x86_64 and aarch64
_SYS_LANDLOCK_ADD_RULE = 445
_SYS_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1

_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_READ_RIGHTS = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR  # ABI 1
_FS_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | (1 << 14)  # all a rule on a file (not a dir) may hold
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


def _open_read_roots(paths):
    """``O_PATH`` descriptors of `paths` (the roots a REPL may read beneath), opened while this process still has
    the trainer's privileges: a private uid may not be able to walk to them by name (a Python installation under
    ``/root``), which the rules need, not the reads (those go through the import directories' descriptors).
    A path this host lacks is skipped. `_install_landlock` closes them."""
    opened = []
    for path in paths:
        try:
            opened.append(os.open(path, os.O_PATH | os.O_CLOEXEC))
        except OSError:
            continue
    return opened


def _install_landlock(home, network, read_root_fds):
    """Restrict this process and its future children (module docstring); ``network``: the limits give model code
    the host's network, so TCP is not restricted; ``read_root_fds``: `_open_read_roots` of where it may read
    besides its home (closed here). Needs ``no_new_privs``. Returns the ABI applied."""
    import ctypes
    import stat
    import struct

    rules = []
    try:
        abi = _landlock_abi()
        if abi < 1:
            raise OSError("Landlock is not available in this kernel")
        write_rights = sum(rights for version, rights in _FS_WRITE_RIGHTS.items() if version <= abi)
        handled = write_rights | _FS_READ_RIGHTS
        device_rights = _FS_WRITE_FILE | _FS_READ_RIGHTS | (_FS_TRUNCATE if abi >= 3 else 0)
        for path, rights in ((home, handled), *((device, device_rights) for device in _WRITABLE_DEVICES)):
            try:
                rules.append((os.open(path, os.O_PATH | os.O_CLOEXEC), rights))
            except OSError:
                continue  # a device this host lacks
        rules += [(fd, _FS_READ_RIGHTS) for fd in read_root_fds]
        read_root_fds = ()
        net = 0 if network or abi < 4 else _NET_BIND_TCP | _NET_CONNECT_TCP
        scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0
        attr = struct.pack("=QQQ", handled, net, scoped)[: 8 if abi < 4 else (16 if abi < 6 else 24)]
        buffer = ctypes.create_string_buffer(attr, len(attr))
        ruleset = _c().syscall(_SYS_LANDLOCK_CREATE_RULESET, buffer, len(attr), 0)
        if ruleset < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"landlock_create_ruleset: {os.strerror(errno)}")
        try:
            for fd, rights in rules:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):  # a file's rule may hold only the rights of files
                    rights &= _FS_FILE_RIGHTS
                rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
                if _c().syscall(_SYS_LANDLOCK_ADD_RULE, ruleset, _LANDLOCK_RULE_PATH_BENEATH, rule, 0) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(
                        errno, f"landlock_add_rule({os.readlink(f'/proc/self/fd/{fd}')}): {os.strerror(errno)}"
                    )
            if _c().syscall(_SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"landlock_restrict_self: {os.strerror(errno)}")
        finally:
            os.close(ruleset)
    finally:
        for fd in (*read_root_fds, *(fd for fd, _rights in rules)):
            os.close(fd)
    return abi
