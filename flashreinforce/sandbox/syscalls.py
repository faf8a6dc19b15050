"""The seccomp filter every call's process runs under, compiled here to BPF with pyseccomp (libseccomp).

The parent compiles it once and hands the BPF bytes to the worker, which loads it with a plain prctl in each
call's child; so nothing inside the sandbox needs libseccomp or pyseccomp. The filter allows everything but
the calls below: the ones that would let code leave its namespaces, reach the kernel's rarely-needed and
often-exploited corners, or keep state past its call (System V IPC and message queues live as long as the
sandbox's IPC namespace, so one call could leave a message for the next).
"""

from __future__ import annotations

import errno
import functools
import tempfile

from flashreinforce.sandbox.records import IsolationError

DENIED = (
    # leave or rejoin namespaces, or build new mounts (creating namespaces via clone is filtered by flag below)
    "setns", "unshare", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsmount", "fsconfig", "fspick", "mount_setattr",
    # look into or drive other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    # kernel attack surface with no use in a tool call
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog", "open_by_handle_at",
    "name_to_handle_at", "lookup_dcookie", "iopl", "ioperm", "vhangup", "fanotify_init",
    # System V IPC and POSIX message queues: they live in the IPC namespace, which outlives the call
    "shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semctl",
    "semtimedop", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    # every socket: the network namespace is empty, and path-based Unix sockets are not covered by it
    "socket",
)

# clone(2) flags that create namespaces: a process must not make itself a fresh user namespace (and with it
# capabilities over new mounts) inside the sandbox.
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
AF_UNIX = 1


@functools.lru_cache(maxsize=1)
def seccomp_program() -> bytes:
    """The filter as raw BPF (struct sock_filter[]), for prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)."""
    try:
        import pyseccomp
    except (ImportError, RuntimeError) as error:  # RuntimeError: pyseccomp found no libseccomp.so.2
        raise IsolationError(f"no seccomp filter ({error}): pip install pyseccomp, and install the system's "
                             "libseccomp (Debian: apt-get install libseccomp2)") from error
    deny = pyseccomp.ERRNO(errno.EPERM)
    program = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in DENIED:
        _add(program, deny, name)
    for flag in NAMESPACE_FLAGS:
        _add(program, deny, "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory, where seccomp cannot look; glibc falls back to clone on ENOSYS.
    _add(program, pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    _add(program, deny, "socketpair", pyseccomp.Arg(0, pyseccomp.NE, AF_UNIX))
    # kill(-1) and kill(-pgid) reach every process of the uid: outside a pid namespace ("none"), the caller's.
    _add(program, deny, "kill", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, 0x80000000, 0x80000000))
    with tempfile.TemporaryFile() as file:
        program.export_bpf(file)
        file.seek(0)
        return file.read()


def _add(program, action: int, name: str, *args) -> None:
    """Add one rule; a call this kernel architecture does not have needs no rule."""
    import pyseccomp

    try:
        number = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)
    except (ValueError, OSError):
        return
    if number < 0:
        return
    program.add_rule(action, number, *args)
