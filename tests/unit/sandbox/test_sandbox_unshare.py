"""The fallback where bubblewrap is missing: util-linux `unshare`, with the worker building the tree itself."""

from __future__ import annotations

import socket

from sandbox_attacks import SLEEPING_FORKS, connect_loopback, read_and_write_outside

from flashreinforce.sandbox.launch import usr_links


def test_a_normal_call_runs_in_scratch_with_a_minimal_tree(unshare_sandbox):
    result = unshare_sandbox.run("import os\nprint(os.getcwd())\nprint(*sorted(os.listdir('/')))\nraise SystemExit(5)")
    assert result.isolation == "unshare" and result.exit_code == 5
    cwd, root = result.output.splitlines()
    assert cwd == "/scratch"
    assert set(root.split()) == {".call", "dev", "proc", "scratch", "tmp", "usr", *usr_links()}  # no /etc, /root


def test_the_network_is_unreachable(unshare_sandbox):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = unshare_sandbox.run(connect_loopback(port))
        listener.settimeout(0.1)
        try:
            listener.accept()
            accepted = True
        except TimeoutError:
            accepted = False
    assert not accepted and result.output.startswith("PermissionError\n")
    assert f":{port:04X}" not in result.output


def test_files_outside_are_not_readable_nor_writable(unshare_sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    result = unshare_sandbox.run(read_and_write_outside(str(secret), str(tmp_path / 'escaped')))
    assert "hunter2" not in result.output and "WROTE" not in result.output
    assert len(result.output.splitlines()) == 6
    assert not (tmp_path / "escaped").exists()


def test_the_process_limit_holds(unshare_sandbox):
    assert int(unshare_sandbox.run(SLEEPING_FORKS).output) == unshare_sandbox.limits.nproc - 1
