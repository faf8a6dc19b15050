"""model.path as a Hugging Face model id: resolved through the Hugging Face cache, offline here (no test reaches
a hub): a cached model loads, an uncached one is an error naming the id and how to use a local directory."""

import pytest

from flashreinforce.models.hub import is_hub_id
from flashreinforce.run.policy import load_policy, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, with the hub out of reach as on a machine without network."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_cached_hub_model_resolves_to_its_snapshot_and_loads(offline_cache, save_chat_model):
    saved = save_chat_model(32, 1)
    repo = offline_cache / "models--someorg--tiny-chat"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.parent.mkdir(parents=True)
    saved.rename(snapshot)  # the layout the hub client writes: refs/main names the snapshot
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    assert resolve_model_path("someorg/tiny-chat") == snapshot
    policy = load_policy(resolve_model_path("someorg/tiny-chat"), field="model.path")
    assert policy.model.config.hidden_size == 32 and policy.tokenizer.eos_token == "<|im_end|>"


def test_an_uncached_hub_model_offline_names_the_id_and_the_way_to_a_local_directory(offline_cache):
    with pytest.raises(ValueError, match=r"model.path=someorg/absent: could not be fetched from the Hugging Face "
                                         r"Hub .*`hf download someorg/absent --local-dir DIR`.* model.path=DIR"):
        resolve_model_path("someorg/absent")


def test_only_org_slash_name_that_is_not_a_local_path_is_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and not is_hub_id("models/Qwen2.5-Math-1.5B/x")
    assert not is_hub_id("/abs/path") and not is_hub_id("./org/name") and not is_hub_id("smollm2-135m-instruct")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # an existing directory is a directory
