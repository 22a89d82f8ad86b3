"""Inside the sandbox: the seccomp filter, the last step of confinement (docs/security.md, class 7)."""

import _struct

from .syscalls import (
    _CLONE_NEWCGROUP,
    _CLONE_NEWIPC,
    _CLONE_NEWNET,
    _CLONE_NEWNS,
    _CLONE_NEWPID,
    _CLONE_NEWUSER,
    _CLONE_NEWUTS,
    _PR_SET_SECCOMP,
    _SECCOMP_MODE_FILTER,
    _c,
    _check,
)

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


_SECCOMP_PROGRAM = _seccomp_program()  # assembled once, in the zygote: every REPL forked from it has it ready


def _install_seccomp():
    import ctypes

    program = _SECCOMP_PROGRAM
    buffer = ctypes.create_string_buffer(program, len(program))

    class _Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = _Program(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _check(_c().prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp filter")
