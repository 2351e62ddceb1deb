"""One rule for every file name plait reads from a file and then opens inside a folder: a
checkpoint's manifest (its digests) and DCP metadata, a Hugging Face folder's safetensors index.
Such a name is data from disk: /dev/zero, ../x, /abs/path or a link would otherwise be opened,
reading from anywhere (a device never ends: the command hangs). Below everything else in plait:
it imports nothing of it."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path


def first_stray(folder: Path, names: Iterable, follow_links: bool = False) -> str | None:
    """The first of `names` that is not a plain file directly inside `folder`, as "'NAME', which is
    not ..." (the end of a sentence), or None. A name whose file does not exist passes: its reader
    says it is missing in its own words. `follow_links`: a link to a plain file passes too (a
    Hugging Face hub snapshot is a folder of links into the hub's blob store)."""
    for name in sorted(names, key=str):
        if not isinstance(name, str) or name in ("", ".", "..") or "\0" in name or Path(name).name != name:
            return f"{name!r}, which is not a file name inside the folder"
        if not isinstance(folder, Path):  # under a URL (plait/storage.py): objects, no links or devices
            if (folder / name).exists() and not (folder / name).is_file():
                return f"{name!r}, which is not a plain file (a folder)"
            continue
        try:
            mode = (os.stat if follow_links else os.lstat)(folder / name).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
            kinds = "a device or a folder" if follow_links else "a link, a device or a folder"
            return f"{name!r}, which is not a plain file ({kinds})"
    return None
