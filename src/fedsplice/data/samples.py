"""Image and image + text samples that travel through the text pipeline unchanged.

Everything downstream of the data (partitions, local training, the frozen-work caches, data
fingerprints) handles a sample as a string: the text itself, or a key that names it. A `Sample`
*is* that key — a `str` whose value identifies the content exactly (data set, split, index, and
any scenario transform applied: `easyvqa/train/17|noimg`) — and carries the content beside it:

    image  uint8 array [H, W] (grey) or [H, W, 3] (RGB), or None when the image is missing
    text   the text modality (a question, caption or name), or None when it is missing

Two samples with the same key have the same content, so caches keyed by the string stay exact.
"""

from __future__ import annotations

import numpy as np


class Sample(str):
    image: np.ndarray | None
    text: str | None

    def __new__(cls, key: str, image: np.ndarray | None = None, text: str | None = None):
        if image is None and text is None:
            raise ValueError(f"sample {key!r} has neither an image nor a text")
        s = super().__new__(cls, key)
        s.image, s.text = image, text
        return s

    def __reduce__(self):  # pickle (spawned workers) without relying on str-subclass defaults
        return (Sample, (str(self), self.image, self.text))

    def derive(self, tag: str, **content) -> Sample:
        """A transformed copy: the key gains `|tag`, and `content` (image=…, text=…) replaces."""
        image = content.get("image", self.image)
        text = content.get("text", self.text)
        return Sample(f"{self}|{tag}", image, text)

    @property
    def has_image(self) -> bool:
        return self.image is not None

    @property
    def has_text(self) -> bool:
        return self.text is not None


def rgb(image: np.ndarray) -> np.ndarray:
    """[H, W] or [H, W, 1|3] uint8 -> [H, W, 3] uint8 (grey images repeat their channel)."""
    if image.ndim == 2:
        image = image[:, :, None]
    if image.ndim != 3 or image.shape[2] not in (1, 3):
        raise ValueError(f"image of shape {tuple(image.shape)}: expected [H, W], [H, W, 1] or [H, W, 3]")
    return np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image


def modalities(items) -> dict[str, int]:
    """How many samples hold an image, a text, both (plain strings count as text)."""
    out = {"image": 0, "text": 0, "both": 0, "n": 0}
    for s in items:
        img = isinstance(s, Sample) and s.has_image
        txt = s.has_text if isinstance(s, Sample) else True
        out["image"] += img
        out["text"] += txt
        out["both"] += img and txt
        out["n"] += 1
    return out
