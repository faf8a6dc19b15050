"""The warm worker inside the sandbox: it waits for calls and forks one fresh child for each.

This file is the program the parent runs in the sandbox, as `python3 -I -c <this source>`: it imports the
stdlib only, since the sandbox binds /usr and nothing of ours. The parent imports it only for the frame
format. The worker never touches a call's code or output. The parent passes a memfd with the code and a pipe
for the output, and the child reads and writes them, so nothing of one call is left in the memory the next
call's child is forked from. The worker is pid 1 of the sandbox's pid namespace ("bwrap", "unshare"), so the
code cannot signal it; it is not dumpable and /proc hides what a call may not trace (hidepid=invisible), so
the code cannot even see it, let alone read its memory or leave notes in its /proc files for the next call.
Before each call it mounts a fresh capped tmpfs for scratch, /tmp and /dev/shm, and unmounts it after.
"""

# The system's python3 may be older than ours: annotations stay unevaluated strings.
from __future__ import annotations

import atexit
import builtins
import ctypes
import dataclasses
import io
import json
import linecache
import os
import platform
import resource
import select
import signal
import socket
import sys
import time
import traceback
import types

FRAME_BYTES = 1 << 16
"""Frames are single SOCK_SEQPACKET messages: small JSON, plus file descriptors."""
SCRATCH = "/scratch"
CALL_ROOT = "/.call"  # the call's tmpfs is mounted here only long enough to bind its parts into place
GUARD_PERIOD_S = 0.02  # how often the resident memory of all the call's processes is summed

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
MNT_DETACH = 2
PR_CAPBSET_DROP, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 24, 4, 22, 36, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, SECCOMP_MODE_FILTER = 47, 4, 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}

_libc = ctypes.CDLL(None, use_errno=True)


@dataclasses.dataclass(frozen=True)
class Mode:
    """How every call of this worker runs, fixed at its start."""

    namespaces: bool  # in our own user, mount and pid namespaces ("bwrap", "unshare"), or not ("none")
    scratch: str
    program: ctypes.Array | None  # the seccomp filter's BPF, or None where the parent had no libseccomp
    nproc_base: int  # processes of our uid that RLIMIT_NPROC counts before the call starts any


def send_frame(sock: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(message).encode()
    assert len(data) <= FRAME_BYTES, f"a {len(data)}-byte frame is over {FRAME_BYTES}"
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def parse_frame(data: bytes) -> dict | None:
    """A frame's message; None for the empty read that means the other side has closed."""
    if not data:
        return None
    message = json.loads(data)
    if not isinstance(message, dict):
        raise TypeError(f"a frame must hold a JSON object, got {type(message).__name__}")
    return message


def _prctl(option: int, *args: int) -> None:
    # prctl is variadic: each argument must go as a full unsigned long, or the kernel sees garbage in the
    # upper half and refuses with EINVAL.
    padded = [ctypes.c_ulong(a) for a in (*args, 0, 0, 0, 0)[:4]]
    _check(_libc.prctl(ctypes.c_int(option), *padded), f"prctl({option})")


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(_bytes(source), _bytes(target), _bytes(fstype), ctypes.c_ulong(flags), _bytes(data)),
           f"mount {source} on {target}")


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def _bind(source: str, target: str, read_only: bool) -> None:
    _mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


# -- the root file system of the "unshare" level (bubblewrap builds its own) -----------------------------------

def build_root(usr_links: list[str]) -> None:
    """Replace / by a tmpfs holding read-only /usr, its symlinks, /proc, a minimal /dev and empty mount points.

    We are root of fresh user, mount and pid namespaces here; the host's tree stays only under /usr.
    """
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    new = "/tmp"  # any directory will do as a mount point; the host's /tmp is untouched outside
    _mount("sandbox", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for name in ("usr", "proc", "dev", "tmp", SCRATCH[1:], CALL_ROOT[1:]):
        os.mkdir(f"{new}/{name}", 0o755)
    _bind("/usr", f"{new}/usr", read_only=True)
    for name in usr_links:
        os.symlink(os.readlink(f"/{name}"), f"{new}/{name}")
    mount_proc(f"{new}/proc")
    _build_dev(f"{new}/dev")
    os.chdir(new)
    # pivot_root(".", ".") stacks the old root under the new one; detaching it leaves only the new tree.
    _check(_libc.syscall(ctypes.c_long(SYS_PIVOT_ROOT[platform.machine()]), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    _mount(None, "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def mount_proc(target: str) -> None:
    """A /proc of our pid namespace that shows a process only to those who may trace it: a call sees its
    own processes, never the worker (pid 1, undumpable)."""
    _mount("proc", target, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")


def _build_dev(dev: str) -> None:
    _mount("sandbox", dev, "tmpfs", MS_NOSUID, "size=64k,mode=0755")
    for name in ("null", "zero", "full", "random", "urandom"):
        open(f"{dev}/{name}", "w").close()
        _mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    os.mkdir(f"{dev}/shm", 0o755)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")


# -- per call: scratch, the child, supervision, cleanup --------------------------------------------------------

def mount_call_tmpfs(limits: dict) -> None:
    """One tmpfs per call, capped in bytes and inodes, bound on /scratch, /tmp and /dev/shm: a call starts
    with all three empty and cannot fill the machine's memory or inode tables through them."""
    inodes = limits["max_files"] + 4  # the tmpfs root and the three directories
    _mount("scratch", CALL_ROOT, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={limits['file_mb']}m,nr_inodes={inodes},mode=0755")
    for name, target, mode in (("scratch", SCRATCH, 0o755), ("tmp", "/tmp", 0o1777), ("shm", "/dev/shm", 0o1777)):
        os.mkdir(f"{CALL_ROOT}/{name}")
        os.chmod(f"{CALL_ROOT}/{name}", mode)
        _mount(f"{CALL_ROOT}/{name}", target, None, MS_BIND)
    _check(_libc.umount2(CALL_ROOT.encode(), MNT_DETACH), f"detach {CALL_ROOT}")


def unmount_call_tmpfs() -> None:
    for target in ("/dev/shm", "/tmp", SCRATCH):
        _check(_libc.umount2(target.encode(), MNT_DETACH), f"detach {target}")


def wipe(directory: str) -> None:
    """The "none" level's scratch is a plain directory: empty it (no tmpfs without namespaces)."""
    for entry in os.scandir(directory):
        if entry.is_dir(follow_symlinks=False):
            os.chmod(entry.path, 0o700)  # the call may have taken its own permissions away
            wipe(entry.path)
            os.rmdir(entry.path)
        else:
            os.unlink(entry.path)


def set_limits(limits: dict, nproc: int) -> None:
    mib = 1 << 20
    # The hard CPU limit sits above the soft one: SIGXCPU first (a catchable, named ending), SIGKILL a second
    # later for code that catches it.
    for name, soft, hard in (("RLIMIT_CPU", limits["cpu_s"], limits["cpu_s"] + 1),
                             ("RLIMIT_FSIZE", limits["file_mb"] * mib, limits["file_mb"] * mib),
                             ("RLIMIT_NOFILE", limits["max_files"], limits["max_files"]),
                             ("RLIMIT_NPROC", nproc, nproc), ("RLIMIT_CORE", 0, 0),
                             ("RLIMIT_AS", limits["memory_mb"] * mib, limits["memory_mb"] * mib)):
        resource.setrlimit(getattr(resource, name), (soft, hard))


def drop_capabilities(in_namespace: bool) -> None:
    """Leave the call with no capabilities, none to regain on exec, and no way to gain privileges at all."""
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    for cap in range(64):
        try:
            _prctl(PR_CAPBSET_DROP, cap)
        except OSError as error:
            if error.errno == 22:  # EINVAL: past the last capability this kernel has
                break
            if in_namespace:  # EPERM outside a namespace of our own: no CAP_SETPCAP, and nothing to drop
                raise
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _check(_libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    with open("/proc/self/status") as lines:
        status = dict(line.split(":", 1) for line in lines if line.startswith("Cap"))
    held = [k for k, v in status.items() if int(v, 16) and (in_namespace or k != "CapBnd")]
    assert not held, f"capabilities left after dropping them: {held}"


def install_filter(program: ctypes.Array | None) -> None:
    if program is None:
        return

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(program) // 8, ctypes.addressof(program))
    _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog))


def enter_call(code_fd: int, out_fd: int, limits: dict, mode: Mode) -> str:
    """In the call's child: the process a fresh `python3 -c CODE` would be, in scratch, fully limited."""
    os.setsid()
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    code = os.pread(code_fd, os.fstat(code_fd).st_size, 0).decode("utf-8", "surrogatepass")
    os.closerange(3, max(3, os.sysconf("SC_OPEN_MAX")))  # the worker's socket, the memfd, the pipe's copies
    os.chdir(mode.scratch)
    os.environ["PWD"] = mode.scratch  # as a shell in scratch would have it (bubblewrap leaves its own "/")
    set_limits(limits, mode.nproc_base + limits["nproc"])
    drop_capabilities(mode.namespaces)
    _prctl(PR_SET_DUMPABLE, 1)  # a plain process again (forked from the undumpable worker): it sees itself
    install_filter(mode.program)
    return code


def run_code(code: str) -> None:
    """Run the code as the interpreter runs a script, then exit; never returns. (The worker imported what
    this needs, so the forked child starts with it loaded.)"""
    # Unbuffered, like `python -u`: stdout and stderr land in the pipe in the order written, and what was
    # printed before a kill (timeout, CPU limit) is still seen.
    def stream(fd: int, mode: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=mode == "w")

    sys.stdin, sys.stdout, sys.stderr = stream(0, "r"), stream(1, "w"), stream(2, "w")
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.argv = ["-c"]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    linecache.cache["<string>"] = (len(code), None, code.splitlines(True), "<string>")  # source in tracebacks
    status = 1
    try:
        status = _execute(code, main)
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()  # join non-daemon threads, as interpreter exit does
        atexit._run_exitfuncs()
    finally:
        os._exit(status)  # whatever happened above (a closed pipe, a failing atexit), the worker's code never runs


def _execute(code: str, main: types.ModuleType) -> int:
    """The interpreter's top level: the exit status of running `code` in `main`."""
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)  # noqa: S102 - running it is this process's job
        return 0
    except SystemExit as error:
        if error.code is None or isinstance(error.code, int):
            return (error.code or 0) & 0xFF
        message = error.code
    except BaseException as error:  # noqa: BLE001 - report it as the interpreter would, and exit 1
        message = "".join(traceback.format_exception(type(error), error, error.__traceback__.tb_next)).rstrip()
    try:
        print(message, file=sys.stderr)
    except OSError:
        pass  # the parent closed the pipe: it stopped reading long ago
    return 1


def resident_bytes() -> int:
    """Resident memory of every process in the sandbox but this one (pid 1)."""
    total = 0
    for name in os.listdir("/proc"):
        if name.isdigit() and name != "1":
            try:
                with open(f"/proc/{name}/statm") as statm:
                    total += int(statm.read().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # it exited while we looked
    return total * os.sysconf("SC_PAGE_SIZE")


def watch(pid: int, control: socket.socket, limits: dict, namespaces: bool) -> tuple[str, float]:
    """Wait for the call's child to exit: "exited", or why we must kill it ("timeout", "memory", "parent")."""
    start = time.monotonic()
    deadline = start + limits["wall_s"]
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(control, select.POLLIN)
    memory = limits["memory_mb"] << 20
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout", time.monotonic() - start
            ready = {fd for fd, _ in poller.poll(min(left, GUARD_PERIOD_S) * 1000)}
            if pidfd in ready:
                return "exited", time.monotonic() - start
            if control.fileno() in ready:
                return "parent", time.monotonic() - start  # it never writes mid-call: this is its exit
            # RLIMIT_AS bounds each process; this bounds them together (nproc of them could hold nproc times).
            if namespaces and resident_bytes() > memory:
                return "memory", time.monotonic() - start
    finally:
        os.close(pidfd)


def signal_everyone(namespaces: bool, pgid: int) -> None:
    """SIGKILL every process the call started, however it detached itself."""
    if namespaces:
        # As pid 1, kill(-1) reaches every other process in our pid namespace, and only those.
        _kill(-1)
        return
    # No pid namespace: the call's session, then the processes reparented to us as their subreaper.
    _kill(-pgid)
    for pid in _descendants():
        _kill(pid)


def reap_everyone(namespaces: bool, pgid: int) -> None:
    """Wait for all of them; orphans of the killed are reparented to us (pid 1, or the subreaper)."""
    while True:
        signal_everyone(namespaces, pgid)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _descendants(pid: str = "self") -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as children:
                for child in children.read().split():
                    found += [int(child), *_descendants(child)]
        except FileNotFoundError:
            continue  # it exited while we looked
    return found


def _processes_of(uid: int) -> int:
    """Processes of `uid` now: RLIMIT_NPROC counts them all where there is no user namespace of our own."""
    count = 0
    for name in os.listdir("/proc"):
        try:
            count += name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid
        except OSError:
            continue
    return count


def serve(request: dict, fds: list[int], control: socket.socket, mode: Mode) -> dict:
    """One call: fork the child from this clean process, watch it, kill what is left, report."""
    if len(fds) != 2:
        raise ValueError(f"a call needs the code's memfd and the output pipe, got {len(fds)} descriptors")
    limits = request["limits"]
    if mode.namespaces:
        mount_call_tmpfs(limits)
    code_fd, out_fd = fds
    pid = os.fork()
    if pid == 0:
        try:
            code = enter_call(code_fd, out_fd, limits, mode)
        except BaseException as error:  # noqa: BLE001 - never run code with a limit missing; say why
            os.write(2, f"sandbox: the call could not be set up: {error!r}\n".encode())
            os._exit(125)
        # Never returns. Even code that hijacks its own process (it may patch os._exit) holds nothing of the
        # worker's: no control socket, no capabilities, every limit and the seccomp filter in place.
        run_code(code)
    os.close(code_fd)
    os.close(out_fd)
    ending, seconds = watch(pid, control, limits, mode.namespaces)
    if ending != "exited":
        signal_everyone(mode.namespaces, pid)
    _, status = os.waitpid(pid, 0)
    reap_everyone(mode.namespaces, pid)
    if mode.namespaces:
        unmount_call_tmpfs()
    else:
        wipe(mode.scratch)
    if ending == "parent":
        sys.exit(0)
    return {"exit_code": os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "ending": ending, "seconds": seconds}


def start(init: dict) -> Mode:
    """Set the worker up from the parent's first frame."""
    namespaces = init["level"] in ("bwrap", "unshare")
    if init["level"] == "unshare":
        build_root(init["usr_links"])
    elif init["level"] == "bwrap":
        mount_proc("/proc")  # over bubblewrap's, which shows every process to everyone
    if namespaces:
        assert os.getpid() == 1, f"the worker must be pid 1 of its pid namespace, is {os.getpid()}"
    else:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        wipe(init["scratch"])
    program = bytes.fromhex(init["program"])
    return Mode(namespaces=namespaces, scratch=SCRATCH if namespaces else init["scratch"],
                program=ctypes.create_string_buffer(program, len(program)) if program else None,
                # RLIMIT_NPROC counts per user and user namespace: ours holds this worker (and under unshare,
                # unshare itself, which made the namespace before it forked us) besides the call.
                nproc_base={"bwrap": 1, "unshare": 2}[init["level"]] if namespaces else _processes_of(os.getuid()))


def main() -> None:
    # Only handled signals reach pid 1 from inside its namespace: with the defaults back, none are.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _prctl(PR_SET_DUMPABLE, 0)
    control = socket.socket(fileno=0)
    mode = start(parse_frame(control.recv(FRAME_BYTES)))
    send_frame(control, {"ready": True})
    while True:
        data, fds, _, _ = socket.recv_fds(control, FRAME_BYTES, 2)
        request = parse_frame(data)
        if request is None:
            return
        send_frame(control, serve(request, fds, control, mode))


if __name__ == "__main__":
    main()
