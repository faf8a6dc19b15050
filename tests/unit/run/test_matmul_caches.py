"""The command line bounds oneDNN's and ideep's kernel caches (cli.MATMUL_CACHE_CAPACITIES) unless the user set them."""

import os

from flashreinforce.cli import MATMUL_CACHE_CAPACITIES, bound_matmul_caches, main


def test_missing_capacities_are_set_and_the_users_are_kept():
    environ = {"LRU_CACHE_CAPACITY": "512"}
    bound_matmul_caches(environ)
    assert environ == {"LRU_CACHE_CAPACITY": "512",
                       "ONEDNN_PRIMITIVE_CACHE_CAPACITY": MATMUL_CACHE_CAPACITIES["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]}


def test_every_command_runs_with_them(monkeypatch, capsys):
    for name in MATMUL_CACHE_CAPACITIES:
        monkeypatch.delenv(name, raising=False)
    main(["config", "trainer"])
    assert {name: os.environ[name] for name in MATMUL_CACHE_CAPACITIES} == MATMUL_CACHE_CAPACITIES
    assert "lr" in capsys.readouterr().out
