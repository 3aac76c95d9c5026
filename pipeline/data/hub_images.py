"""``python -m pipeline fetch-data``: a hub dataset's files, pinned (`pipeline.storage.hub_data`), then the image
files its records name beside them.

A dataset repo may keep its images as files next to the data (LLaVA's layout: a record names
``images/0001.png``, relative to its data file). The URL matches the data files only, so once they are pinned
their records are read, with the dataset's ``data.columns`` / ``data.roles``, and every image path inside the
commit's snapshot that the cache lacks is downloaded from the same commit (a table is read for them only where
its image column holds paths: `may_name_files`). A folder missing more than
`MAX_LISTED` images is fetched whole (``<folder>/*``: one pattern, not thousands). An image that is not in the
repo at that commit stays missing, and validation names it. Offline (``HF_HUB_OFFLINE=1``) nothing more is
fetched: validation names each missing image with the ``hf download`` that fetches it.
"""

from __future__ import annotations

import glob
import posixpath
from collections import defaultdict
from pathlib import Path

from pipeline.data import columnar, hub_splits, readers
from pipeline.data.formats import stream_file
from pipeline.data.kinds import is_columnar
from pipeline.data.shapes import FieldMap, add_arguments, fields_of
from pipeline.storage import hub_data
from pipeline.storage.hub import download, offline

MAX_LISTED = 64  # missing images of one folder asked for by name; more: the folder


def snapshot_of(pin: str | Path) -> Path:
    """The cache snapshot folder of a pin's commit (its files are inside it)."""
    info = hub_data.read_pin(pin)
    parts = Path(info["files"][0]).parts
    return Path(*parts[:parts.index(info["revision"]) + 1])


def may_name_files(pin: str | Path, fields: FieldMap) -> bool:
    """Can the pinned dataset's records name image files? JSON, JSON Lines, CSV: yes. A table (Parquet, Arrow) only
    where its image column holds paths (strings): a `datasets` Image column (the hub's vision-language datasets)
    brings its images inside the data, and reading every row for nothing would decode them all where Snakemake
    runs (validation reads them, in its own jobs)."""
    import pyarrow as pa

    try:
        kind = readers.sniff(Path(pin))
    except readers.KindError:
        return False  # validation names what the files are
    if not is_columnar(kind):
        return True
    found = columnar.schema(Path(hub_data.pinned_files(pin)[0]), kind)
    if found is None:
        return False

    def paths(t) -> bool:
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            return paths(t.value_type)
        return pa.types.is_string(t) or pa.types.is_large_string(t)

    return any(paths(found.field(key).type) for key in {fields.key("image"), fields.key("images")}
               if key in found.names)


def missing_images(pin: str | Path, fields: FieldMap) -> list[str]:
    """The images a pinned hub dataset's records name inside its commit's snapshot that the cache lacks, as paths
    in the repo, sorted (records with problems too: their images are checked as well)."""
    if not may_name_files(pin, fields):
        return []
    snapshot = snapshot_of(pin)
    parsed, stream = stream_file(pin, fields, fingerprint=False)
    found: set[str] = set()
    for record in [*stream, *parsed.rejected]:
        for image in record.images:
            path = Path(image)
            if path.is_relative_to(snapshot) and not path.exists():
                found.add(path.relative_to(snapshot).as_posix())
    return sorted(found)


def patterns(paths: list[str]) -> list[str]:
    """`hf download --include` patterns for `paths` (repo paths): each by name, or its folder's ``<folder>/*``
    where that folder misses more than `MAX_LISTED`."""
    by_folder: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        by_folder[posixpath.dirname(path)].append(path)
    out = []
    for folder, files in sorted(by_folder.items()):
        out += [f"{glob.escape(folder)}/*"] if folder and len(files) > MAX_LISTED else [glob.escape(f) for f in files]
    return out


def fetch_images(pin: str | Path, fields: FieldMap) -> tuple[int, int]:
    """Download the images the pinned dataset's records name that the cache lacks; (asked for, still missing)."""
    wanted = missing_images(pin, fields)
    if not wanted:
        return 0, 0
    info = hub_data.read_pin(pin)
    url = info["url"]
    download(f"the images of {url}", lambda: hub_data.fetch_files(info["repo_id"], info["revision"], patterns(wanted)),
             lambda: None, f"{url}: its images are not in the Hugging Face cache")
    snapshot = snapshot_of(pin)
    still = sum(not (snapshot / path).exists() for path in wanted)
    return len(wanted), still


def main(argv: list[str] | None = None) -> int:
    parser = hub_data.arguments()
    add_arguments(parser)
    parser.add_argument("--split", choices=sorted(hub_splits.SPLIT_WORDS), default="train",
                        help="for a URL naming a whole repo (hf://datasets/org/name): the split to fetch")
    args = parser.parse_args(argv)
    hub_data.write_pin(args.url, args.out, choose=hub_splits.choose(args.split))
    if offline():
        return 0
    wanted, still = fetch_images(args.out, fields_of(args))
    if wanted:
        print(f"{args.url}: {wanted - still} of {wanted} image file(s) its records name fetched beside the data"
              + (f"; {still} not in the repo at that commit (validation names each)" if still else ""))
    return 0
