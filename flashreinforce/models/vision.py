"""Images for the policy: our tiny vision encoder in front of a causal LM, and the one placeholder contract.

A prompt's text holds one image token (`<image>`) per attached image. `expand_image_placeholders`
(models/image_tokens.py) turns each into
the run of image tokens the encoder fills (16 for a 64x64 image here), once, when the prompt is rendered to ids;
the engine and the trainer both read those expanded ids and the same image bytes, so behavior and recomputed
log-probs describe the same inputs. Text that already holds an expanded run is refused (the double expansion
that corrupted TRL's SmolVLM prompts), as is a placeholder count that differs from the image count.

`VisionLM` takes `pixel_values` in its forward like Hugging Face's VLM classes do: the encoder's outputs replace
the image tokens' embeddings, in row-major order of the placeholders, and the LM runs on `inputs_embeds`. Its
positions are the LM's own 1D ones, so the engine's KV cache, masks and position ids hold unchanged. Image tokens
are never sampled (`banned_token_ids`), and the trainer's recompute bans them too: a sampled placeholder would
have no image behind it (verl #7038). Saved as the LM's Hugging Face folder (AutoModelForCausalLM loads the text
model from it) plus vision.safetensors and vision_config.json.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from flashreinforce.models.checkpointing import checkpoint_layers
from flashreinforce.models.image_tokens import IMAGE_TOKEN, ImagePlaceholders, expand_image_placeholders

__all__ = ["IMAGE_TOKEN", "ImagePlaceholders", "VisionConfig", "VisionLM", "build_vision_lm",
           "expand_image_placeholders", "load_vision_lm"]

VISION_CONFIG = "vision_config.json"
VISION_WEIGHTS = "vision.safetensors"


@dataclass(frozen=True)
class VisionConfig:
    """The tiny encoder's shape: image_size / patch_size patches a side, merged merge x merge into one token."""

    image_size: int = 64
    patch_size: int = 8
    width: int = 64
    num_layers: int = 2
    num_heads: int = 4
    merge: int = 2
    image_token_id: int = 3
    """The LM's id of IMAGE_TOKEN."""

    def __post_init__(self) -> None:
        grid, problems = self.image_size // self.patch_size, []
        if self.image_size % self.patch_size:
            problems.append(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if grid % self.merge:
            problems.append(f"the {grid}x{grid} patch grid does not split into merge={self.merge} squares")
        if self.width % self.num_heads:
            problems.append(f"width {self.width} is not divisible by num_heads {self.num_heads}")
        if problems:
            raise ValueError("vision config: " + "; ".join(problems))

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size // self.merge) ** 2


def decode_image(data: bytes, size: int) -> np.ndarray:
    """(size, size, 3) uint8 RGB of an encoded image, resized when it is not size x size."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        image = image.convert("RGB")
        if image.size != (size, size):
            image = image.resize((size, size), Image.Resampling.BILINEAR)
        return np.asarray(image, dtype=np.uint8)


class _Block(nn.Module):
    """A pre-norm transformer layer written out: torch's TransformerEncoderLayer takes a different fast path in
    eval mode, and the engine (eval) and the trainer (train) must compute the same function."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, S, W)
        n, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v)  # (N, heads, S, W/heads)
        x = x + self.proj(attended.transpose(1, 2).reshape(n, s, w))
        return x + self.mlp(self.norm2(x))


class TinyVisionEncoder(nn.Module):
    """Patchify, a few transformer layers, merge neighbouring patches, project to the LM's width."""

    def __init__(self, config: VisionConfig, hidden_size: int) -> None:
        super().__init__()
        self.config = config
        grid = config.image_size // config.patch_size
        self.patchify = nn.Conv2d(3, config.width, config.patch_size, stride=config.patch_size)
        self.positions = nn.Parameter(torch.randn(1, grid * grid, config.width) * 0.02)
        self.blocks = nn.ModuleList(_Block(config.width, config.num_heads) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.width)
        merged = config.width * config.merge**2
        self.projector = nn.Sequential(nn.Linear(merged, hidden_size), nn.GELU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) in [-1, 1] -> (N, tokens_per_image, hidden)."""
        c = self.config
        x = self.patchify(pixel_values).flatten(2).transpose(1, 2) + self.positions  # (N, g*g, W)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        n, g, m = x.shape[0], c.image_size // c.patch_size, c.merge
        x = x.view(n, g // m, m, g // m, m, c.width).permute(0, 1, 3, 2, 4, 5).reshape(n, (g // m) ** 2, -1)
        return self.projector(x)


class VisionLM(nn.Module):
    """A causal LM that reads images: `forward(input_ids, ..., pixel_values=None)`, as Hugging Face VLMs take them."""

    def __init__(self, language_model: nn.Module, vision: TinyVisionEncoder) -> None:
        super().__init__()
        self.language_model = language_model
        self.vision = vision

    # What the rest of the code reads off a Hugging Face model, answered by the LM.
    @property
    def config(self) -> Any:
        return self.language_model.config

    @property
    def generation_config(self) -> Any:
        return self.language_model.generation_config

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.dtype

    @property
    def device(self) -> torch.device:
        return self.language_model.device

    @property
    def image_token_id(self) -> int:
        return self.vision.config.image_token_id

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """Ids the policy may never sample (the trainer's recompute bans them too)."""
        return (self.image_token_id,)

    def tokens_per_image(self, images: Sequence[bytes]) -> list[int]:
        return [self.vision.config.tokens_per_image] * len(images)

    @property
    def placeholders(self) -> ImagePlaceholders:
        return ImagePlaceholders(self.image_token_id, self.vision.config.tokens_per_image)

    def image_inputs(self, images: Sequence[bytes]) -> dict[str, torch.Tensor]:
        """The forward's image arguments for these encoded images, in placeholder order."""
        size = self.vision.config.image_size
        pixels = np.stack([decode_image(data, size) for data in images])  # (N, S, S, 3) uint8
        tensor = torch.from_numpy(pixels).permute(0, 3, 1, 2).to(self.device, torch.float32)
        return {"pixel_values": (tensor / 127.5 - 1.0).to(self.dtype)}

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None) -> None:
        checkpoint_layers(self.language_model, activation_checkpointing_kwargs)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None, **kwargs: Any) -> Any:
        embeds = self.language_model.get_input_embeddings()(input_ids)  # (B, T, H)
        placeholders = input_ids == self.image_token_id  # (B, T)
        if pixel_values is not None:
            features = self.vision(pixel_values.to(embeds.dtype)).reshape(-1, embeds.shape[-1])  # (N * tokens, H)
            if features.shape[0] != int(placeholders.sum()):
                raise ValueError(f"{int(placeholders.sum())} image tokens in input_ids for {features.shape[0]} image "
                                 "features: the ids and the images disagree (expand placeholders once, by "
                                 "expand_image_placeholders)")
            embeds = embeds.masked_scatter(placeholders[..., None], features.to(embeds.dtype))
        elif bool(placeholders.any()):
            raise ValueError("image tokens in input_ids but no pixel_values: pass the row's images")
        return self.language_model(inputs_embeds=embeds, **kwargs)

    def save_pretrained(self, directory: str | Path, **kwargs: Any) -> None:
        """The LM as a Hugging Face folder, plus the encoder's weights and config beside it."""
        directory = Path(directory)
        state_dict = kwargs.pop("state_dict", None)
        vision_state = {k.removeprefix("vision."): v for k, v in (state_dict or {}).items() if k.startswith("vision.")}
        if state_dict is not None:
            kwargs["state_dict"] = {k.removeprefix("language_model."): v for k, v in state_dict.items()
                                    if k.startswith("language_model.")}
        self.language_model.save_pretrained(directory, **kwargs)
        tensors = vision_state or self.vision.state_dict()
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(directory / VISION_WEIGHTS))
        (directory / VISION_CONFIG).write_text(json.dumps(asdict(self.vision.config), indent=2) + "\n")


def build_vision_lm(language_model: nn.Module, config: VisionConfig, *, seed: int = 0) -> VisionLM:
    """A fresh encoder (weights a function of `seed` only; the global RNG untouched) in front of the LM."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vision = TinyVisionEncoder(config, language_model.config.hidden_size)
    return VisionLM(language_model, vision.to(language_model.dtype))


def is_vision_dir(path: str | Path) -> bool:
    return (Path(path) / VISION_CONFIG).is_file()


def load_vision_lm(path: str | Path, language_model: nn.Module) -> VisionLM:
    """The encoder saved beside `language_model`'s folder, attached to it."""
    path = Path(path)
    try:
        config = VisionConfig(**json.loads((path / VISION_CONFIG).read_text()))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path / VISION_CONFIG}: not a vision config this version reads ({error}); save the "
                         "model again") from error
    model = VisionLM(language_model, TinyVisionEncoder(config, language_model.config.hidden_size))
    missing, unexpected = model.vision.load_state_dict(load_file(str(path / VISION_WEIGHTS)), strict=False)
    if missing or unexpected:
        raise ValueError(f"{path / VISION_WEIGHTS}: missing {missing[:5]}, unexpected {unexpected[:5]}: the encoder's "
                         f"weights do not match {VISION_CONFIG}; save the model again")
    return model.to(language_model.dtype)
