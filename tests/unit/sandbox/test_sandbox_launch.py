"""The command lines: what bubblewrap and unshare are told, read as flags (no sandbox is started here)."""

from __future__ import annotations

import itertools
import os

from flashreinforce.sandbox.launch import (
    NOBODY,
    bwrap_launch,
    none_launch,
    unshare_launch,
    usr_links,
)


def _pairs(argv: tuple[str, ...], flag: str) -> list[tuple[str, ...]]:
    return [tuple(argv[i + 1:i + 3]) for i, a in enumerate(argv) if a == flag]


def test_bwrap_binds_only_usr_read_only_and_nothing_writable():
    links = usr_links()
    argv = bwrap_launch("/usr/bin/bwrap", "/usr/bin/python3", links).argv
    assert _pairs(argv, "--ro-bind") == [("/usr", "/usr")]  # never `--ro-bind / /`: /etc/passwd, /root, /home
    assert not {"--bind", "--dev-bind", "--bind-try", "--ro-bind-try", "--tmpfs"} & set(argv)
    assert ("--remount-ro", "/") in itertools.pairwise(argv)
    assert _pairs(argv, "--symlink") == [(os.readlink(f"/{name}"), f"/{name}") for name in links]


def test_bwrap_unshares_every_namespace_and_clears_the_environment():
    argv = bwrap_launch("/usr/bin/bwrap", "/usr/bin/python3", []).argv
    for flag in ("--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                 "--die-with-parent", "--new-session", "--as-pid-1", "--clearenv"):
        assert flag in argv, flag
    assert [name for name, _ in _pairs(argv, "--setenv")] == ["PATH", "HOME", "LANG"]
    assert argv.index("--") < argv.index("-I")  # the worker's source comes after every bwrap flag


def test_a_root_parent_runs_every_level_as_nobody():
    launches = [bwrap_launch("bwrap", "python3", []), unshare_launch("unshare", "python3"),
                none_launch("python3", "/tmp/x")]
    expected = NOBODY if os.geteuid() == 0 else None
    assert [launch.user for launch in launches] == [expected] * 3


def test_unshare_makes_user_net_pid_and_mount_namespaces():
    launch = unshare_launch("unshare", "/usr/bin/python3")
    for flag in ("--user", "--map-root-user", "--mount", "--pid", "--fork", "--net", "--ipc", "--kill-child"):
        assert flag in launch.argv, flag
    assert sorted(launch.env) == ["HOME", "LANG", "PATH"]


def test_usr_links_are_only_symlinks_into_usr(tmp_path):
    (tmp_path / "usr" / "lib").mkdir(parents=True)
    (tmp_path / "lib").symlink_to("usr/lib")
    (tmp_path / "lib64").mkdir()  # a real directory: not a link to copy
    (tmp_path / "bin").symlink_to("/opt/bin")  # a link elsewhere: not ours to copy either
    assert usr_links(str(tmp_path)) == ["lib"]
