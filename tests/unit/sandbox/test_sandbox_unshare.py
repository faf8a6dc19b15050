"""The fallback where bubblewrap is missing: util-linux `unshare`, with the worker building the tree itself."""

from __future__ import annotations

import socket

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
        code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                "    print('CONNECTED')\nexcept OSError as error:\n    print(type(error).__name__)\n"
                "print(open('/proc/net/tcp').read())")
        result = unshare_sandbox.run(code)
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
    code = (f"for path in ({str(secret)!r}, '/etc/passwd', '/root'):\n    try:\n        print(open(path).read())\n"
            "    except OSError as error:\n        print(type(error).__name__)\n"
            f"for path in ({str(tmp_path / 'escaped')!r}, '/usr/escaped', '/escaped'):\n    try:\n"
            "        open(path, 'w')\n        print('WROTE', path)\n    except OSError as error:\n"
            "        print(type(error).__name__)")
    result = unshare_sandbox.run(code)
    assert "hunter2" not in result.output and "WROTE" not in result.output
    assert len(result.output.splitlines()) == 6
    assert not (tmp_path / "escaped").exists()


def test_the_process_limit_holds(unshare_sandbox):
    code = ("import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
            "            time.sleep(10)\n            os._exit(0)\n        n += 1\nexcept BlockingIOError:\n    pass\nprint(n)")
    assert int(unshare_sandbox.run(code).output) == unshare_sandbox.limits.nproc - 1
