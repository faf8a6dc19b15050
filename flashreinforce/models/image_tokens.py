"""The placeholder contract, without torch: one IMAGE_TOKEN per image in prompt text, expanded once into the run of
image tokens the model fills with the image's features (models/vision.py). The engine and the trainer both read the
expanded ids, so they cannot disagree about where an image sits; re-expanding expanded ids is refused."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

IMAGE_TOKEN = "<image>"
"""The placeholder of one image in prompt text (verl's geometry3k layout)."""


@dataclass(frozen=True)
class ImagePlaceholders:
    """What rendering a prompt needs of a model that reads images: its image token and the run each image fills."""

    image_token_id: int
    tokens_per_image: int

    def expand(self, ids: Sequence[int], images: Sequence[bytes], *, where: str = "prompt") -> list[int]:
        return expand_image_placeholders(ids, self.image_token_id, [self.tokens_per_image] * len(images), where=where)


def expand_image_placeholders(ids: Sequence[int], image_token_id: int, counts: Sequence[int], *,
                              where: str = "prompt") -> list[int]:
    """`ids` with the i-th image token repeated counts[i] times: the only place placeholders are expanded.

    Each image is one token in `ids`; an adjacent pair means text that was expanded already, an error like a
    placeholder count that differs from len(counts)."""
    positions = [j for j, t in enumerate(ids) if t == image_token_id]
    if any(b == a + 1 for a, b in zip(positions, positions[1:])):
        raise ValueError(f"{where}: adjacent {IMAGE_TOKEN} tokens: these ids were expanded already (one placeholder "
                         "per image goes in; the expansion happens once)")
    if len(positions) != len(counts):
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
