"""Which level a Sandbox runs at: "none" only by explicit opt-in."""

import shutil

import pytest

import flashreinforce.sandbox.sandbox as sandbox_module
from flashreinforce.sandbox import IsolationError, Sandbox, probe_isolation


def test_none_without_the_opt_in_is_refused_naming_the_opt_in():
    with pytest.raises(IsolationError, match=r"allow_unisolated=True \(the python_tool environment: "
                                             r"env.options.allow_unisolated=true; the command: "
                                             r"`flashreinforce sandbox --allow-unisolated`\)"):
        Sandbox(isolation="none")


def test_an_unknown_level_is_a_value_error():
    with pytest.raises(ValueError, match="isolation must be"):
        Sandbox(isolation="docker")


def test_none_with_the_opt_in_runs_and_says_so():
    with Sandbox(isolation="none", allow_unisolated=True) as sandbox:
        result = sandbox.run("print(6 * 7)")
    assert (sandbox.level, result.isolation, result.output, result.exit_code) == ("none", "none", "42\n", 0)


def test_the_probe_finds_a_level_and_auto_uses_it():
    level = probe_isolation()
    assert level in ("bwrap", "unshare", "none")
    if level == "none":
        pytest.skip("no sandbox works here: auto refuses without the opt-in")
    with Sandbox() as sandbox:
        assert sandbox.level == level
        assert sandbox.run("print('ok')").output == "ok\n"


@pytest.fixture
def missing(monkeypatch):
    """Hide tools from the sandbox's PATH lookups: missing("bwrap") is a host without bubblewrap."""
    real = shutil.which
    hidden = set()
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name, *a, **k: None if name in hidden else real(name))
    sandbox_module._probe.cache_clear()
    yield hidden.update
    sandbox_module._probe.cache_clear()  # the next test probes the real host again


def test_auto_falls_back_to_unshare_where_bubblewrap_is_missing(missing):
    missing({"bwrap"})
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    with Sandbox() as sandbox:
        assert sandbox.level == "unshare" and sandbox.run("print('ok')").output == "ok\n"


def test_auto_with_no_sandbox_names_both_fixes(missing):
    missing({"bwrap", "unshare"})
    assert probe_isolation() == "none"
    with pytest.raises(IsolationError, match=r"apt-get install bubblewrap.*allow_unisolated=True"):
        Sandbox()
    with pytest.raises(IsolationError, match="bwrap is not installed"):
        Sandbox(isolation="bwrap")
