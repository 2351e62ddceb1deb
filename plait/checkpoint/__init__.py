"""Checkpoints: the manifest and the checks before a load (`manifest`), the save/resume machinery
(`checkpointer`), the files' digests (`digests`) and DCP reads that cannot run code (`safe_dcp`)."""
