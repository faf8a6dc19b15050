"""Hugging Face vision-language models (AutoModelForImageTextToText) behind the interface of models/vision.py.

The families that run here take their images as pixels at prefill, under the engine's explicit position ids and 4D
causal masks: LLaVA (CLIP or SigLIP tower), Idefics3 / SmolVLM (one global image each, no splitting) and InternVL
(one tile, no cropping) with plain 1D positions, and Qwen2-VL / Qwen2.5-VL at dynamic resolution with 3D M-RoPE
positions (`rope_positions`: the model's own get_rope_index over a whole row, which the engine applies at prefill and
continues at decode from each request's offset, and the trainer applies to its rows). Qwen3-VL and ERNIE-VL lay out
their M-RoPE otherwise (a 1D arange is accepted silently and gives other log-probs), Gemma3 and PaliGemma need
bidirectional attention among image tokens (the causal mask overrides it). Those are refused at load, and so is
anything not tested here.

The placeholder contract (models/image_tokens.py) is the same as our own VisionLM's: prompt text holds one image
token per image, expanded once to each image's run of copies. That run is all the forward needs: it scatters each
image's features into the image-token positions in order, so the engine and the trainer read the same inputs. The
`<image>` of a data file is rewritten to the family's own text for one image (its wrapper tokens around its image
token, e.g. InternVL's `<img><IMG_CONTEXT></img>`) when the tokenizer names the image token. Wrapper tokens are
never sampled (`banned_token_ids`, read from the folder's tokenizer files).

Images go from bytes through PIL and the family's `*ImageProcessorPil` (never torchvision, whose only reachable build
breaks transformers here), one image at a time, so an image's pixels never depend on what it is batched with.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flashreinforce.models.checkpointing import checkpoint_layers
from flashreinforce.models.image_tokens import IMAGE_TOKEN, ImagePlaceholders

__all__ = ["SUPPORTED_FAMILIES", "HFVisionLM", "check_family", "image_processor_for", "is_hf_vision_dir",
           "load_hf_vision_lm"]

IMAGE_PROCESSOR_CONFIG = "preprocessor_config.json"
PROCESSOR_CONFIG = "processor_config.json"
"""Newer processors nest the image processor's settings here, under "image_processor"."""


@dataclass(frozen=True)
class _Family:
    vision_modules: tuple[str, ...]
    """Attributes of the HF model's `.model` that make up the tower and the projector (frozen together)."""
    text_module: str
    """Attribute of `.model` holding the decoder (its forward names the KV-cache keyword)."""
    images_axis: bool
    """pixel_values as (1, n_images, C, H, W) instead of (n_images, C, H, W)."""
    process_kwargs: tuple[tuple[str, Any], ...] = ()
    """Image processor options forced at call time: one image in, one fixed-size image out."""
    special_tokens: str = r"(?!)"
    """Regex of the family's other image special tokens (banned from sampling along with the image token)."""
    prompt_text: str = "{image}"
    """One image in a prompt of the family's checkpoints: its wrapper tokens around the image token ({image})."""
    mrope: bool = False
    """Qwen2-VL's way: dynamic resolution (pixel_values as patches plus image_grid_thw, image tokens per image by
    size) and 3D M-RoPE positions, computed by the model's own get_rope_index."""


_IDEFICS3 = _Family(("vision_model", "connector"), "text_model", True, (("do_image_splitting", False),),
                    r"<fake_token_around_image>|<global-img>|<row_\d+_col_\d+>",
                    "<fake_token_around_image><global-img>{image}<fake_token_around_image>")
# The video and vision-pad tokens are banned too: a sampled <|video_pad|> has no video to fill it (verl #7038).
_QWEN2_VL = _Family(("visual",), "language_model", False, (), r"<\|vision_start\|>|<\|vision_end\|>|"
                    r"<\|vision_pad\|>|<\|video_pad\|>", "<|vision_start|>{image}<|vision_end|>", mrope=True)
_FAMILIES = {
    "llava": _Family(("vision_tower", "multi_modal_projector"), "language_model", False),
    "idefics3": _IDEFICS3,
    "smolvlm": _IDEFICS3,
    "internvl": _Family(("vision_tower", "multi_modal_projector"), "language_model", False,
                        (("crop_to_patches", False),), r"<img>|</img>", "<img>{image}</img>"),
    "qwen2_vl": _QWEN2_VL,
    "qwen2_5_vl": _QWEN2_VL,
}
SUPPORTED_FAMILIES = tuple(_FAMILIES)

_MROPE = ("computes its 3D M-RoPE positions its own way (timestamps, deepstack features or its own layout), which "
          "only Qwen2-VL's and Qwen2.5-VL's are followed here")
_REFUSED = {
    "qwen3_vl": f"Qwen3-VL {_MROPE}",
    "qwen3_vl_moe": f"Qwen3-VL-MoE {_MROPE}",
    "ernie4_5_vl_moe": f"ERNIE-4.5-VL {_MROPE}",
    "gemma3": "Gemma3 attends bidirectionally among an image's tokens, which the engine's causal 4D mask overrides",
    "paligemma": "PaliGemma attends bidirectionally over its image-and-prompt prefix, which the engine's causal 4D "
                 "mask overrides",
}
_LLAVA_TOWERS = {"clip_vision_model": 1, "siglip_vision_model": 0}
"""LLaVA vision towers tested here, with the number of class tokens each prepends to its patches."""


def _square(value: int | Sequence[int], what: str) -> int:
    sides = [value] * 2 if isinstance(value, int) else list(value)
    if sides[0] != sides[1]:
        raise ValueError(f"{what} {sides}: only square sizes are supported")
    return int(sides[0])


def _geometry(config: Any) -> tuple[int, int]:
    """(image side in pixels, image tokens per image) from a supported family's config, refusing what would break
    the count (a tower we have not tested, a feature grid the family cannot reshape)."""
    vision, kind = config.vision_config, config.model_type
    side, patch = _square(vision.image_size, "image_size"), _square(vision.patch_size, "patch_size")
    if side % patch:
        raise ValueError(f"{kind}: image_size {side} is not a multiple of patch_size {patch}")
    grid = side // patch
    if kind == "llava":
        if vision.model_type not in _LLAVA_TOWERS:
            raise ValueError(f"llava with a {vision.model_type} tower is not tested; supported towers: "
                             f"{sorted(_LLAVA_TOWERS)}")
        # The "default" strategy drops the first feature (CLIP's class token; a patch of a SigLIP tower).
        dropped = 1 if config.vision_feature_select_strategy == "default" else 0
        return side, grid * grid + _LLAVA_TOWERS[vision.model_type] - dropped
    if kind == "internvl":
        if config.vision_feature_select_strategy != "default":
            raise ValueError("internvl: vision_feature_select_strategy must be 'default' (with the class token the "
                             "features do not form the square grid the pixel shuffle needs)")
        merged = grid * config.downsample_ratio
        if merged != int(merged):
            raise ValueError(f"internvl: a {grid}x{grid} patch grid does not shrink by downsample_ratio "
                             f"{config.downsample_ratio} to whole patches")
        return side, int(merged) ** 2
    if grid % config.scale_factor:  # idefics3, smolvlm
        raise ValueError(f"{kind}: a {grid}x{grid} patch grid does not split into scale_factor={config.scale_factor}"
                         " squares")
    return side, (grid // config.scale_factor) ** 2


def check_family(config: Any) -> None:
    """A ValueError naming the family and why, unless the engine can run this VLM config exactly."""
    kind = config.model_type
    if kind in _REFUSED:
        raise ValueError(f"{kind} is not supported yet: {_REFUSED[kind]}. Supported vision-language families: "
                         f"{', '.join(SUPPORTED_FAMILIES)}")
    if kind not in _FAMILIES:
        raise ValueError(f"vision-language family {kind!r} is not tested; supported: {', '.join(SUPPORTED_FAMILIES)}")
    vocab = config.get_text_config().vocab_size
    if not 0 <= config.image_token_id < vocab:
        raise ValueError(f"{kind}: image_token_id {config.image_token_id} is outside the LM's vocabulary [0, {vocab})")
    if not _FAMILIES[kind].mrope:  # Qwen2-VL sizes each image's token run by the image (dynamic resolution)
        _geometry(config)


def image_processor_for(config: Any) -> Any:
    """The family's PIL image processor sized for this config's tower (for a model built from a config, which
    has no preprocessor_config.json): one image in, one side x side image out."""
    import transformers

    check_family(config)
    if _FAMILIES[config.model_type].mrope:
        vision = config.vision_config
        factor = vision.patch_size * vision.spatial_merge_size  # one image token per merged patch of factor^2 pixels
        return transformers.Qwen2VLImageProcessorPil(
            patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
            temporal_patch_size=vision.temporal_patch_size,
            size={"shortest_edge": 4 * factor**2, "longest_edge": 64 * factor**2},
        )
    side = _geometry(config)[0]
    square = {"height": side, "width": side}
    if config.model_type == "llava":
        if config.vision_config.model_type == "clip_vision_model":
            return transformers.CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size=square)
        return transformers.SiglipImageProcessorPil(size=square)
    if config.model_type == "internvl":
        return transformers.GotOcr2ImageProcessorPil(size=square, crop_to_patches=False)
    cls = transformers.SmolVLMImageProcessorPil if config.model_type == "smolvlm" else \
        transformers.Idefics3ImageProcessorPil
    return cls(do_image_splitting=False, size={"longest_edge": side}, max_image_size={"longest_edge": side})


class HFVisionLM(nn.Module):
    """A Hugging Face VLM plus its image processor, read by the engine and the trainer like models/vision.py's
    VisionLM: `config` is the text config, images come in as bytes, image tokens are never sampled.

    The HF model's children are this module's own children under their HF names, so `state_dict()` keys are the
    checkpoint's (weight pushes, save_pretrained(state_dict=...) and a vLLM engine need no renaming); the HF model
    object itself is kept unregistered and runs the forward.
    """

    def __init__(self, model: nn.Module, image_processor: Any, *, extra_banned_token_ids: Sequence[int] = (),
                 image_token: str | None = None) -> None:
        """`extra_banned_token_ids`: the family's other image special tokens (ids outside the LM are dropped);
        `image_token`: the image token's text in the checkpoint's tokenizer, when known."""
        super().__init__()
        check_family(model.config)
        object.__setattr__(self, "_hf", model)  # not registered: its children are, just below
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, parameter in model.named_parameters(recurse=False):
            self.register_parameter(name, parameter)
        for name, buffer in model.named_buffers(recurse=False):
            self.register_buffer(name, buffer)
        self.image_processor = image_processor
        self._family = _FAMILIES[model.config.model_type]
        self._side, self._tokens = (0, 0) if self._family.mrope else _geometry(model.config)
        vocab = self.config.vocab_size
        extra = sorted({t for t in extra_banned_token_ids if 0 <= t < vocab} - {self.image_token_id})
        self._banned = (self.image_token_id, *extra)
        # The text a prompt's placeholder must be for the tokenizer to give image_token_id (None: unknown).
        self.image_token = image_token
        self.train(model.training)

    # What the rest of the code reads off a Hugging Face model.
    @property
    def hf_model(self) -> nn.Module:
        return self._hf

    @property
    def config(self) -> Any:
        """The text config: vocab_size, attention implementation, positions, layer types."""
        return self._hf.config.get_text_config()

    @property
    def vlm_config(self) -> Any:
        """The full VLM config (what config.json holds)."""
        return self._hf.config

    @property
    def generation_config(self) -> Any:
        return self._hf.generation_config

    @property
    def dtype(self) -> torch.dtype:
        return self._hf.dtype

    @property
    def device(self) -> torch.device:
        return self._hf.device

    @property
    def language_model(self) -> nn.Module:
        """The decoder alone (the engine reads its forward's KV-cache keyword)."""
        return getattr(self._hf.model, self._family.text_module)

    @property
    def vision(self) -> nn.ModuleDict:
        """The vision tower and projector, e.g. for `model.vision.requires_grad_(False)`."""
        return nn.ModuleDict({name: getattr(self._hf.model, name) for name in self._family.vision_modules})

    @property
    def image_token_id(self) -> int:
        return int(self._hf.config.image_token_id)

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """The image token and the family's other image special tokens: never sampled, banned in the recompute."""
        return self._banned

    def tokens_per_image(self, images: Sequence[bytes]) -> list[int]:
        if not self._family.mrope:
            return [self._tokens] * len(images)
        merged = self._hf.config.vision_config.spatial_merge_size ** 2
        return [int(self._processed(data)["image_grid_thw"].prod()) // merged for data in images]

    @property
    def placeholders(self) -> ImagePlaceholders:
        text = IMAGE_TOKEN if self.image_token is None else self._family.prompt_text.format(image=self.image_token)
        count = self.tokens_per_image if self._family.mrope else None
        return ImagePlaceholders(self.image_token_id, self._tokens, text, count)

    def get_input_embeddings(self) -> nn.Module:
        return self._hf.get_input_embeddings()

    def image_inputs(self, images: Sequence[bytes]) -> dict[str, torch.Tensor]:
        """The forward's image arguments for these encoded images, in placeholder order."""
        if self._family.mrope:  # each image's patches, one after another, and each image's (t, h, w) patch grid
            processed = [self._processed(data) for data in images]
            patches = torch.cat([torch.as_tensor(out["pixel_values"], dtype=torch.float32) for out in processed])
            return {"pixel_values": patches.to(self.device, self.dtype),
                    "image_grid_thw": torch.cat([self._grid(out) for out in processed]).to(self.device)}
        pixels = torch.cat([self._pixels(data) for data in images])  # (N, C, S, S)
        if self._family.images_axis:
            # Idefics3 drops all-zero images as padding: a real one would lose its features and the count break.
            if bool((pixels.flatten(1) == 0).all(-1).any()):
                raise ValueError("an image preprocesses to all-zero pixels, which Idefics3 takes for padding")
            pixels = pixels[None]  # (1, N, C, S, S): features come out in the same order, matched to ids in order
        return {"pixel_values": pixels.to(self.device, self.dtype)}

    def rope_positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       images: Sequence[Sequence[bytes]]) -> torch.Tensor | None:
        """(3, B, T) M-RoPE positions of rows of ids (each row's images in placeholder order), by the model's own
        get_rope_index: an image's tokens sit on its (t, h, w) grid, text runs on from the largest position before
        it. 0 at padding. None for a family with plain 1D positions."""
        if not self._family.mrope:
            return None
        flat = [image for row in images for image in row]
        grids = torch.cat([self._grid(self._processed(data)) for data in flat]) if flat else None
        positions, _ = self._hf.model.get_rope_index(
            input_ids, mm_token_type_ids=(input_ids == self.image_token_id).int(), image_grid_thw=grids,
            attention_mask=attention_mask,
        )
        return positions

    @staticmethod
    def _grid(processed: Any) -> torch.Tensor:
        return torch.as_tensor(processed["image_grid_thw"], dtype=torch.long).reshape(-1, 3)

    def _processed(self, data: bytes) -> Any:
        """The family's PIL image processor's output for one encoded image."""
        from PIL import Image

        with Image.open(io.BytesIO(data)) as image:
            return self.image_processor(images=[image.convert("RGB")], return_tensors="pt",
                                        **dict(self._family.process_kwargs))

    def _pixels(self, data: bytes) -> torch.Tensor:
        """(1, C, S, S) float32 pixels of one encoded image, through the family's PIL image processor."""
        out = self._processed(data)
        pixels = torch.as_tensor(out["pixel_values"], dtype=torch.float32)
        pixels = pixels.reshape(-1, *pixels.shape[-3:])
        if pixels.shape[0] != 1 or tuple(pixels.shape[-2:]) != (self._side, self._side):
            raise ValueError(f"the image processor ({type(self.image_processor).__name__}) made pixels of shape "
                             f"{tuple(pixels.shape)} from one image; the model reads one {self._side}x{self._side} "
                             f"image: fix the sizes in {IMAGE_PROCESSOR_CONFIG}")
        return pixels

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._hf(*args, **kwargs)

    def train(self, mode: bool = True) -> HFVisionLM:
        super().train(mode)
        self._hf.training = mode  # the HF model's own flag (its children follow from super())
        return self

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None) -> None:
        checkpoint_layers(self._hf, activation_checkpointing_kwargs)

    def save_pretrained(self, directory: str | Path, **kwargs: Any) -> None:
        """The HF folder (config.json, weights) plus the image processor's preprocessor_config.json; `state_dict`
        (HF names, as this module's state_dict) replaces the live weights as in PreTrainedModel.save_pretrained."""
        self._hf.save_pretrained(directory, **kwargs)
        self.image_processor.save_pretrained(directory)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_hf_vision_dir(path: str | Path) -> bool:
    """Whether the folder's config.json describes a Hugging Face image-text-to-text model (any family: the
    unsupported ones are then refused by load_hf_vision_lm with the reason)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    config = _read_json(Path(path) / "config.json")
    if not isinstance(config, dict):
        return False
    return "vision_config" in config or config.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def _added_tokens(path: Path) -> dict[int, str]:
    """Id -> text of the added (special) tokens in the folder's tokenizer files ({} without them)."""
    tokens = {}
    tokenizer = _read_json(path / "tokenizer.json")
    for token in tokenizer.get("added_tokens", []) if isinstance(tokenizer, dict) else []:
        tokens[int(token["id"])] = str(token.get("content", ""))
    tokenizer_config = _read_json(path / "tokenizer_config.json")
    decoder = tokenizer_config.get("added_tokens_decoder", {}) if isinstance(tokenizer_config, dict) else {}
    for token_id, token in decoder.items():
        tokens[int(token_id)] = str(token.get("content", ""))
    return tokens


def _has_image_processor_config(path: Path) -> bool:
    nested = _read_json(path / PROCESSOR_CONFIG)
    return (path / IMAGE_PROCESSOR_CONFIG).is_file() or (isinstance(nested, dict) and "image_processor" in nested)


def load_hf_vision_lm(path: str | Path, *, dtype: torch.dtype = torch.float32,
                      attn_implementation: str = "sdpa") -> HFVisionLM:
    """The VLM saved in a local folder (never the network), with its PIL image processor; the family is checked
    before any weight is read."""
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText

    path = Path(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_family(config)
    if not _has_image_processor_config(path):
        raise ValueError(f"{path}: {IMAGE_PROCESSOR_CONFIG} is missing: a vision-language model needs its image "
                         f"processor's settings; copy {IMAGE_PROCESSOR_CONFIG} from the original checkpoint, or save "
                         "one there (image_processor_for(config).save_pretrained(path))")
    # backend="pil" on every machine: a torchvision build elsewhere must not change the pixels the trainer sees.
    image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True, backend="pil")
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    added = _added_tokens(path)
    pattern = _FAMILIES[config.model_type].special_tokens
    banned = [token_id for token_id, text in added.items() if re.fullmatch(pattern, text)]
    return HFVisionLM(model, image_processor, extra_banned_token_ids=banned,
                      image_token=added.get(int(config.image_token_id)))
