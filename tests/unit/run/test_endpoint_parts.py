"""run/endpoint.py and the config of agent runs: what starts the endpoint, and the errors that name the fix."""

import importlib.util

import pytest

from flashreinforce.config import load_config
from flashreinforce.endpoint.chat import HERMES_TEMPLATE
from flashreinforce.run.endpoint import agent_functions, chat_template, check_endpoint, serves_endpoint


def test_an_agent_task_or_serve_starts_the_endpoint():
    assert not serves_endpoint(load_config(None))
    assert serves_endpoint(load_config(None, ["endpoint.serve=true"]))
    agent = load_config(None, ["env.kind=agent", "env.agent=a.py:run"])
    assert serves_endpoint(agent) and agent_functions(agent) == {"": "a.py:run"}


@pytest.mark.parametrize(("overrides", "message"), [
    (["env.kind=agent"], "set env.agent=path/to/agent.py:run"),
    (["env.agent=a.py:run"], "set env.kind=agent"),
])
def test_the_agent_and_its_kind_go_together(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def _extra(monkeypatch, installed: set[str]) -> None:
    """The endpoint extra's packages as installed (or not) whatever this environment holds: the checks after the
    extra's are tested in the README's test command too, which installs no extra."""
    find_spec = importlib.util.find_spec

    def spec(name, *args):
        if name in ("aiohttp", "openai"):
            return find_spec("json") if name in installed else None
        return find_spec(name, *args)
    monkeypatch.setattr(importlib.util, "find_spec", spec)


def test_the_chat_template_is_the_tokenizers_a_named_one_or_a_file(tmp_path, monkeypatch):
    _extra(monkeypatch, {"aiohttp", "openai"})
    assert chat_template(load_config(None)) is None
    assert chat_template(load_config(None, ["endpoint.chat_template=hermes"])) == HERMES_TEMPLATE
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    assert chat_template(load_config(None, [f"endpoint.chat_template={tmp_path / 't.jinja'}"])) == "{{ messages }}"
    with pytest.raises(ValueError, match="neither one of"):
        check_endpoint(load_config(None, ["endpoint.serve=true", "endpoint.chat_template=nope.jinja"]))


def test_a_missing_extra_and_another_backend_are_refused_saying_what_to_do(monkeypatch):
    _extra(monkeypatch, {"aiohttp", "openai"})
    with pytest.raises(ValueError, match="backend.kind=local"):
        check_endpoint(load_config(None, ["env.kind=agent", "env.agent=a.py:run", "backend.kind=ray"]))
    _extra(monkeypatch, {"openai"})
    with pytest.raises(ValueError, match=r"env.kind=agent needs aiohttp: pip install -e '.\[endpoint\]'"):
        check_endpoint(load_config(None, ["env.kind=agent", "env.agent=a.py:run"]))
