"""Importing the user's own files by path: one module per path, a failed import leaves nothing behind."""

import sys

import pytest

from flashreinforce.user_code import import_file


def test_two_files_of_one_name_are_two_modules_and_each_imports_once(tmp_path):
    first, second = tmp_path / "a" / "rewards.py", tmp_path / "b" / "rewards.py"
    for path, value in ((first, 1), (second, 2)):
        path.parent.mkdir()
        path.write_text(f"VALUE = {value}\nimport itertools\nCOUNTER = itertools.count()\n")
    a, b = import_file(first, "reward"), import_file(second, "reward")
    assert (a.VALUE, b.VALUE) == (1, 2)
    assert a.__name__ != b.__name__ and sys.modules[a.__name__] is a
    next(a.COUNTER)
    assert import_file(first, "reward") is a and next(a.COUNTER) == 1  # not executed again


def test_a_file_that_fails_is_not_left_half_imported_and_imports_once_fixed(tmp_path):
    path = tmp_path / "env.py"
    path.write_text("raise RuntimeError('broken at import')\n")
    with pytest.raises(RuntimeError, match="broken at import"):
        import_file(path, "env")
    assert not [name for name in sys.modules if name.startswith("_flashreinforce_env_env_")]
    path.write_text("OK = True\n")
    assert import_file(path, "env").OK


def test_a_dataclass_in_the_file_resolves_its_module_while_it_runs(tmp_path):
    path = tmp_path / "agent.py"
    # string annotations make dataclass look the class's module up in sys.modules while the file runs
    path.write_text("from __future__ import annotations\nfrom dataclasses import dataclass\n\n@dataclass\n"
                    "class Row:\n    x: int\n")
    assert import_file(path, "agent").Row(3).x == 3
