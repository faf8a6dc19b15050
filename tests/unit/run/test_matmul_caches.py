"""The command line bounds oneDNN's and ideep's kernel caches (cli.MATMUL_CACHE_CAPACITIES) unless the user set them."""

import os

from flashreinforce.cli import MATMUL_CACHE_CAPACITIES, bound_matmul_caches, main


def test_missing_capacities_are_set_and_the_users_are_kept():
    environ = {"LRU_CACHE_CAPACITY": "512"}
    bound_matmul_caches(environ)
    assert environ == {"LRU_CACHE_CAPACITY": "512",
                       "ONEDNN_PRIMITIVE_CACHE_CAPACITY": MATMUL_CACHE_CAPACITIES["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]}


def test_every_command_runs_with_them(monkeypatch, capsys):
    # a copy without them, so what main sets does not outlive the test (delenv restores only what it deleted)
    environ = {name: value for name, value in os.environ.items() if name not in MATMUL_CACHE_CAPACITIES}
    monkeypatch.setattr(os, "environ", environ)
    main(["config", "trainer"])
    assert {name: environ[name] for name in MATMUL_CACHE_CAPACITIES} == MATMUL_CACHE_CAPACITIES
    assert "lr" in capsys.readouterr().out
