"""model.path as a Hugging Face model id (ORG/NAME): fetched once into the Hugging Face cache, then read from
there as any local directory. Offline (HF_HUB_OFFLINE=1, or no network), a cached id still resolves; an uncached
one is an error saying how to point at a local directory instead."""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""ORG/NAME, as the Hub spells a model; a path of ours that looks like one is taken as a path if it exists."""

MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
"""Weights as safetensors, configs, tokenizer and chat template: not the .bin, .pth, GGUF or ONNX copies that
some repositories carry beside them."""


def is_hub_id(path: str) -> bool:
    return bool(HUB_ID.match(path)) and not Path(path).exists()


def fetch_hub_model(model_id: str, *, field: str = "model.path") -> Path:
    """The local directory of `model_id` in the Hugging Face cache, downloading what it lacks."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        directory = Path(snapshot_download(model_id, allow_patterns=MODEL_FILES))
    except RepositoryNotFoundError:
        raise ValueError(f"{field}={model_id}: no such model on the Hugging Face Hub (or it is private: log in "
                         "with `hf auth login`); a local directory is taken as is") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        raise ValueError(f"{field}={model_id}: could not be fetched from the Hugging Face Hub ({type(error).__name__}: "
                         f"{str(error).splitlines()[0]}); where this machine has no network, download it on one that "
                         f"has (`hf download {model_id} --local-dir DIR`), copy DIR here and set {field}=DIR") from None
    if not any(directory.glob("*.safetensors")):
        raise ValueError(f"{field}={model_id}: the Hub repository has no safetensors weights (only .bin or other "
                         "formats, which are not loaded); convert it with save_pretrained and pass the directory")
    return directory
