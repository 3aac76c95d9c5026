"""The image files of a dataset: present, decodable, of a sane size; opened the one way.

Validation checks every image before anything is trained (`check_image`); the
vision-language side opens them with `open_rgb` when it turns them into tokens
and pixels. Sane sizes are bounds no vision processor we know handles outside
of: below `MIN_SIDE` an image is smaller than one patch of any vision encoder,
beyond `MAX_PIXELS` Pillow itself suspects a decompression bomb, and beyond
`MAX_ASPECT` Qwen2-VL's resize refuses the image (others squash it to noise).
"""

from __future__ import annotations

import hashlib
import os

MIN_SIDE = 4  # px, each side: fewer is a tracking pixel or a thumbnail of nothing
MAX_PIXELS = 64 * 2**20  # width x height; Pillow warns from 89M on
MAX_ASPECT = 200  # longer side / shorter side


def check_image(path: str) -> tuple[str, str] | None:
    """(reason, message) if the image at `path` is missing, does not decode or has an insane size, else None.

    Decodes the whole image (a truncated JPEG passes a header check); reasons:
    ``image_missing``, ``image_undecodable``, ``image_size``.
    """
    from PIL import Image

    if not os.path.isfile(path):
        return "image_missing", f"image file not found: {path}"
    try:
        with Image.open(path) as image:
            width, height = image.size
            if width * height > MAX_PIXELS:  # before decoding it: that is the point of the bound
                return "image_size", f"{path} is {width}x{height}: more than {MAX_PIXELS} pixels"
            image.load()
    except Exception as err:  # Pillow raises many types for a broken file
        return "image_undecodable", f"cannot decode image {path}: {err}"
    if min(width, height) < MIN_SIDE:
        return "image_size", f"{path} is {width}x{height}: a side under {MIN_SIDE} px"
    if max(width, height) > MAX_ASPECT * min(width, height):
        return "image_size", f"{path} is {width}x{height}: aspect ratio over {MAX_ASPECT}"
    return None


def open_rgb(path: str):
    """The image at `path`, decoded, as an RGB `PIL.Image` (what every image processor takes)."""
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def file_digest(path: str) -> str:
    """sha256 of the file's bytes: the same picture under two names is one image."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
