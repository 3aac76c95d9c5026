"""Where the export commands may write, and how they write without leaving half a result.

Two guarantees, both checked before the first byte is written:

* inputs are only read: an output equal to, inside, or containing an input
  directory (the base model above all) is refused with a `UserError`;
* an existing non-empty output dir is replaced only with `--overwrite`.

Outputs are built in a hidden sibling staging dir and published at the end
(`pipeline.storage.publish`), so a crash never leaves something that looks like
a finished model (Snakemake would otherwise take a partial dir for a result).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from pipeline.errors import UserError
from pipeline.storage import publish


def _resolved(path: Path | str) -> Path:
    # resolve() follows symlinks, so a link pointing into the base is caught too.
    return Path(path).expanduser().resolve()


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def refuse_overlaps(outputs: Mapping[str, Path | str | None], inputs: Mapping[str, Path | str | None]) -> None:
    """Refuse outputs that overlap an input dir or each other.

    `outputs` / `inputs` map a label (the CLI flag, for the message) to a path;
    None entries are skipped. "Overlap" is equality or either path lying inside
    the other: writing into the base corrupts it, and replacing a parent of the
    base (`--overwrite`) would delete it.
    """
    outs = {label: _resolved(p) for label, p in outputs.items() if p is not None}
    ins = {label: _resolved(p) for label, p in inputs.items() if p is not None}
    for out_label, out in outs.items():
        for in_label, src in ins.items():
            if _overlap(out, src):
                raise UserError(
                    f"{out_label} {out} overlaps {in_label} {src}: inputs are read-only, "
                    "write the output somewhere outside the input directories"
                )
    labels = list(outs)
    for i, first in enumerate(labels):
        for second in labels[i + 1:]:
            if _overlap(outs[first], outs[second]):
                raise UserError(f"{first} {outs[first]} and {second} {outs[second]} overlap; give separate dirs")


def check_replaceable(out: Path | str, *, overwrite: bool, label: str = "output") -> None:
    """Refuse an existing file, or a non-empty dir unless `overwrite`."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{label} {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{label} {out} exists and is not empty; remove it or pass --overwrite")


@contextmanager
def staged_dir(out: Path | str, *, overwrite: bool, label: str = "output") -> Iterator[Path]:
    """Yield an empty staging dir; on normal exit it becomes `out` (old contents replaced).

    Refuses a non-empty `out` unless `overwrite` first; on an exception the
    staging dir is removed and `out` is left untouched (`storage.publish`).
    """
    check_replaceable(out, overwrite=overwrite, label=label)
    with publish.staged_dir(out) as stage:
        yield stage
