"""Reading DCP checkpoints without running code from them.

`torch.distributed.checkpoint` keeps a checkpoint's metadata (`.metadata`) as a pickle, which
its FileSystemReader opens with `pickle.load`, and loads non-tensor values (the optimizer's
param-group entries) with `torch.load(weights_only=False)`: a crafted file in a downloaded
checkpoint folder runs any code it likes the moment it is read (the digests cannot help: they
live in the same folder). Here the metadata is unpickled by an unpickler that builds only the
classes DCP metadata is made of, and non-tensor values by torch's weights-only unpickler, which
builds only tensors and plain Python values. Every DCP read plait does goes through this module,
and every write: a folder under a URL (plait/storage.py) is read and written through fsspec.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

# What DCP's metadata pickle is made of in torch 2.13 (read off checkpoints of every layout).
ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                               "TensorStorageMetadata", "BytesStorageMetadata",
                                               "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name
    "torch": {"Size"},  # and the dtypes, by name (below)
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # the checkpoint's id
}


class UnsafeCheckpoint(Exception):
    """A checkpoint file asks to build something that is not checkpoint data."""


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"its .metadata asks to build {module}.{name}, which is not part of DCP metadata "
                               "(a crafted file would run code this way); refused, nothing from it was run")


class SafeMetadata:
    """A DCP reader's metadata through MetadataUnpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as file:
            metadata = MetadataUnpickler(file).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"its .metadata holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeReader(SafeMetadata, FileSystemReader):
    """FileSystemReader whose metadata comes through MetadataUnpickler."""


class SafeFsspecReader(SafeMetadata, FsspecReader):
    """FsspecReader (a folder under a URL) whose metadata comes through MetadataUnpickler."""


class SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor values with the weights-only unpickler."""

    def load_bytes(self, read_item, value) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            # torch's message opens with advice to load without weights_only: the one line that says what it refused
            why = next((line for line in str(e).splitlines() if "GLOBAL" in line), "not plain data")
            raise UnsafeCheckpoint(f"{read_item.dest_index.fqn} is not checkpoint data ({why.rstrip('.')}); refused, "
                                   "nothing from it was run") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def reader(folder) -> FileSystemReader:
    return SafeReader(str(folder)) if isinstance(folder, Path) else \
        SafeFsspecReader(str(folder), **folder.storage_options)


def writer(folder) -> FileSystemWriter:
    """DCP's writer of `folder`: a local path's, or fsspec's for a URL's (plait/storage.py)."""
    return FileSystemWriter(str(folder)) if isinstance(folder, Path) else \
        FsspecWriter(str(folder), **folder.storage_options)


def read_metadata(folder) -> Metadata:
    return reader(folder).read_metadata()


def load(state: dict, folder, **kwargs) -> None:
    """`dcp.load(state, ...)` of `folder` in place, through a safe reader and SafePlanner."""
    dcp.load(state, storage_reader=reader(folder), planner=SafePlanner(), **kwargs)
