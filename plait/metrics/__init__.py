"""Watching a run: the console lines, metrics.jsonl and TensorBoard (`logger`), the end-of-run
summary (`summary`), a resumed run's TensorBoard files without the steps it trains again
(`tensorboard_events`), Weights & Biases (`wandb_log`, optional) and the curves in a PNG (`plot`)."""
