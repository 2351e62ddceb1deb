"""The optimizer side: AdamW and Muon (`optimizers`), the learning-rate schedules (`schedule`) and
gradient clipping by the global norm (`clipping`)."""
