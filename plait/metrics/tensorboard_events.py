"""A TensorBoard folder as a resumed run must find it: no events of the steps it trains again.

A run that stopped after its last checkpoint had logged steps its resumption trains (and logs)
again. The JSONL drops their rows (MetricsLogger); the event files are append-only, so they are
rewritten here without those steps' events. The SummaryWriter's purge_step alone is not enough:
it is a marker that tensorboard's own loader honours, while the files still hold every step
twice for anything that reads them as they are (tbparse, `wandb sync`, a script), and a new run
(resumed from nothing) set no marker at all.
"""

from __future__ import annotations

import os
from pathlib import Path

from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.summary.writer.record_writer import RecordWriter


def drop_events_after(folder: str, step: int) -> None:
    """Rewrite every event file in `folder` without the events of steps after `step`; remove a
    file left with nothing but its header."""
    for path in sorted(Path(folder).glob("events.out.tfevents.*")) if Path(folder).is_dir() else []:
        records = list(RawEventFileLoader(str(path)).Load())
        kept = [record for record in records if Event.FromString(record).step <= step]
        if len(kept) == len(records):
            continue
        if all(Event.FromString(record).HasField("file_version") for record in kept):
            path.unlink()
            continue
        tmp = path.with_name(".plait-rewrite.tmp")  # no "tfevents" in it: TensorBoard never reads it
        writer = RecordWriter(open(tmp, "wb"))
        for record in kept:
            writer.write(record)
        writer.close()
        os.replace(tmp, path)
