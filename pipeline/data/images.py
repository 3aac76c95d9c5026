"""The image files of a dataset: present, decodable, of a sane size; opened the one way.

Validation checks every image before anything is trained (`check_image`); the
vision-language side opens them with `open_rgb` when it turns them into tokens
and pixels. An image a record holds as its bytes (a `datasets` Image column,
the form of the hub's vision-language datasets, or a `data:` URL) is written
once to a file named by its sha256 (`write_embedded`) under `store_dir()`, and
from then on is that file: every job that reads the record names the same one.

Sane sizes are bounds no vision processor we know handles outside of: below
`MIN_SIDE` an image is smaller than one patch of any vision encoder, beyond
`MAX_PIXELS` Pillow itself suspects a decompression bomb, and beyond
`MAX_ASPECT` Qwen2-VL's resize refuses the image (others squash it to noise).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import threading

MIN_SIDE = 4  # px, each side: fewer is a tracking pixel or a thumbnail of nothing
MAX_PIXELS = 64 * 2**20  # width x height; Pillow warns from 89M on
MAX_ASPECT = 200  # longer side / shorter side


# The file name's suffix, from the bytes' own signature (Pillow reads the content, not the name).
_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", ".png"), (b"\xff\xd8\xff", ".jpg"), (b"GIF87a", ".gif"), (b"GIF89a", ".gif"),
               (b"BM", ".bmp"), (b"II*\x00", ".tif"), (b"MM\x00*", ".tif"))


def store_dir() -> str:
    """Where embedded images are written: `sft-pipeline/images` in the Hugging Face cache's root (HF_HOME,
    else $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface), the place a workflow's jobs already share
    for hub models and datasets. Read from the environment at each call."""
    root = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(root), "sft-pipeline", "images")


def _suffix(data: bytes) -> str:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return ".webp"
    return next((suffix for signature, suffix in _SIGNATURES if data.startswith(signature)), ".img")


def write_embedded(data: bytes) -> str:
    """The path of the file holding `data` (`store_dir()/<2 hex>/<sha256><suffix>`), written if absent.

    The name depends on the bytes alone, so any process gets the same path for the same image, and a
    concurrent writer of the same image is harmless (each writes a file of its own, then renames it into
    place). OSError where the store cannot be written."""
    digest = hashlib.sha256(data).hexdigest()
    path = os.path.join(store_dir(), digest[:2], digest + _suffix(data))
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.{os.getpid()}-{threading.get_ident()}.partial"
        with open(partial, "wb") as f:
            f.write(data)
        os.replace(partial, path)
    return path


def data_url_bytes(url: str) -> bytes | None:
    """The bytes of a base64 `data:` URL (`data:image/png;base64,...`); None for any other form."""
    head, comma, body = url.partition(",")
    if not comma or not head.startswith("data:") or not head.endswith(";base64"):
        return None
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        return None


def check_image(path: str) -> tuple[str, str] | None:
    """(reason, message) if the image at `path` is missing, does not decode or has an insane size, else None.

    Decodes the whole image (a truncated JPEG passes a header check); reasons:
    ``image_missing``, ``image_undecodable``, ``image_size``.
    """
    from PIL import Image

    if not os.path.isfile(path):
        return "image_missing", f"image file not found: {path}{_not_fetched(path)}"
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


# A file in a Hugging Face cache snapshot of a dataset repo: <cache>/datasets--<org>--<name>/snapshots/<commit>/<path>
_HUB_SNAPSHOT = re.compile(r"/datasets--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})"
                           r"/(?P<path>.+)$")


def _not_fetched(path: str) -> str:
    """What to do about a missing image: inside a hub dataset's cache snapshot (the records of a
    hf://datasets/... URL name it beside the data, and it was not fetched: offline, or not in the repo), how to
    get it; elsewhere, where the data's relative paths start."""
    found = _HUB_SNAPSHOT.search(path.replace(os.sep, "/"))
    if found is None:
        return (" (the data's relative image paths start from the dataset file's directory, or from "
                "data.image_dir where it is set)")
    repo, folder = f"{found['org']}/{found['name']}", os.path.dirname(found["path"])
    include = f"{folder}/*" if folder else found["path"]
    return (f" (a file of the hub dataset {repo} at commit {found['commit'][:12]} that the cache lacks: fetch_data "
            "downloads the images the records name when it runs online, so it ran offline or the repo has no such "
            f"file. Fetch the images with `hf download {repo} --repo-type dataset --revision {found['commit']} "
            f"--include '{include}'` into the same cache, give the data with the images embedded, or, where the "
            "images are elsewhere, set data.image_dir to their directory)")


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
