"""The placeholder contract, without torch: one IMAGE_TOKEN per image in prompt text, expanded once into the run of
image tokens the model fills with the image's features (models/vision.py). The engine and the trainer both read the
expanded ids, so they cannot disagree about where an image sits; re-expanding expanded ids is refused."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flashreinforce.types import IMAGE_TOKEN  # the shared vocabulary's, so envs check placeholders without torch


@dataclass(frozen=True)
class ImagePlaceholders:
    """What rendering a prompt needs of a model that reads images: its image token, the run each image fills, and
    the text that stands for one image in the model's own prompts."""

    image_token_id: int
    tokens_per_image: int
    """Image tokens per image, when every image has the same number (0 when `count` decides)."""
    text: str = IMAGE_TOKEN
    """One image in the model's prompt text (Qwen2-VL: `<|vision_start|><|image_pad|><|vision_end|>`), the
    IMAGE_TOKEN of data files is rewritten to it before tokenizing."""
    count: Callable[[Sequence[bytes]], list[int]] | None = None
    """Image tokens of each image, for models whose count depends on the image's size (dynamic resolution)."""

    def expand(self, ids: Sequence[int], images: Sequence[bytes], *, where: str = "prompt") -> list[int]:
        counts = self.count(images) if self.count is not None else [self.tokens_per_image] * len(images)
        return expand_image_placeholders(ids, self.image_token_id, counts, where=where)

    def render(self, text: str) -> str:
        """`text` with each IMAGE_TOKEN written the model's way (placeholders stay one per image)."""
        return text if self.text == IMAGE_TOKEN else text.replace(IMAGE_TOKEN, self.text)


def expand_image_placeholders(ids: Sequence[int], image_token_id: int, counts: Sequence[int], *,
                              where: str = "prompt") -> list[int]:
    """`ids` with the i-th image token repeated counts[i] times: the only place placeholders are expanded.

    Each image is one token in `ids`, so two images side by side (`<image><image>`) are two adjacent tokens. Ids
    expanded already hold sum(counts) image tokens instead of len(counts): refused, saying so, as is any other
    placeholder count that differs from the number of images."""
    positions = [j for j, t in enumerate(ids) if t == image_token_id]
    if len(positions) != len(counts):
        if sum(counts) != len(counts) and _expanded_runs(positions, counts):
            raise ValueError(f"{where}: {len(positions)} {IMAGE_TOKEN} tokens for {len(counts)} images, as many as "
                             "their expansion holds: these ids were expanded already (one placeholder per image goes "
                             "in; the expansion happens once)")
        raise ValueError(f"{where}: {len(positions)} {IMAGE_TOKEN} placeholders for {len(counts)} images; give "
                         f"one {IMAGE_TOKEN} in the text per attached image")
    out, image = [], 0
    for token in ids:
        if token == image_token_id:
            out.extend([image_token_id] * counts[image])
            image += 1
        else:
            out.append(token)
    return out


def _expanded_runs(positions: Sequence[int], counts: Sequence[int]) -> bool:
    """Do the image tokens at `positions` form the expansion of `counts`: runs of adjacent tokens, each run the
    images' counts in order (images side by side share one run)?"""
    runs: list[int] = []
    for a, b in zip([None, *positions], positions):
        if a is not None and b == a + 1:
            runs[-1] += 1
        else:
            runs.append(1)
    remaining = list(counts)
    for run in runs:
        while run > 0 and remaining and remaining[0] <= run:
            run -= remaining.pop(0)
        if run:
            return False
    return not remaining
