"""Weights & Biases, an optional sink of rank 0's metrics (`pip install -e ".[wandb]"`), imported
only by a run that sets metrics.wandb_project.

A run that resumes from checkpoint.folder continues the W&B run it belongs to: the W&B run's id
is kept in that folder (wandb-run-id, next to plait-job.json). A run that starts from step 0
starts a new W&B run (and records its id there)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from plait.config import ConfigError, JobConfig

RUN_ID_FILE = "wandb-run-id"


def check_wandb(cfg: JobConfig) -> None:
    """At start-up, before any process group: the W&B options fit together, and wandb is installed."""
    m = cfg.metrics
    if not m.wandb_project:
        for name in ("wandb_run_name", "wandb_offline"):
            if getattr(m, name):
                raise ConfigError(f"metrics.{name}: set metrics.wandb_project too (which W&B project is the run's?)")
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError('metrics.wandb_project: the wandb package is not installed: pip install -e ".[wandb]" '
                          "(or pip install wandb)") from None


def wandb_sinks(cfg: JobConfig, model_args: dict, resumed_step: int) -> list:
    """MetricsLogger's W&B sink, if metrics.wandb_project asks for one. A W&B that cannot start
    (not logged in, no network) does not stop the training job: one warning line, no W&B."""
    if not cfg.metrics.wandb_project:
        return []
    import wandb

    try:
        return [WandbRun(cfg, model_args, resumed_step)]
    except wandb.Error as e:
        print(f"plait: warning: W&B did not start ({str(e).strip().splitlines()[0]}): this run is not logged there; "
              "--metrics.wandb_offline writes it to a local folder to upload later", flush=True)
        return []


class WandbRun:
    """Rank 0's W&B run: MetricsLogger's rows as its history at their step, the run's end-of-run
    summary as its summary, the job's options and model as its config."""

    def __init__(self, cfg: JobConfig, model_args: dict, resumed_step: int):
        import wandb

        m = cfg.metrics
        id_file = Path(cfg.checkpoint.folder, RUN_ID_FILE) if cfg.checkpoint.folder else None
        resumed = resumed_step > 0 and id_file is not None and id_file.is_file()
        self.run = wandb.init(project=m.wandb_project, name=m.wandb_run_name or None,
                              id=id_file.read_text().strip() if resumed else None,
                              resume="allow" if resumed else None, mode="offline" if m.wandb_offline else None)
        # After init, allowing changes: a resumed run may change steps, lr and the like, which
        # W&B would refuse in init's config.
        self.run.config.update({**dataclasses.asdict(cfg), "model_args": model_args}, allow_val_change=True)
        if id_file is not None and not resumed:
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(self.run.id + "\n")
        # Online, a resumed W&B run already holds the steps its crashed run logged, and refuses
        # (warning each time) those it would log again: the steps replayed after the checkpoint,
        # which plait's bitwise resume trains to the same values. Offline this is 0.
        self.first_step = self.run.starting_step

    def log(self, row: dict) -> None:
        if row["step"] >= self.first_step:
            self.run.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])

    def finish(self, summary: dict) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if v is not None})

    def close(self) -> None:
        # Called from the training loop's `finally`: the exception on its way out, if any, is the
        # run's end (a preemption's exit code is 128 + the signal, an error's 1).
        error = sys.exc_info()[1]
        self.run.finish(exit_code=0 if error is None else getattr(error, "exit_code", 1))
        # finish() can return before W&B's service process has written the run (its last records
        # were seen missing); teardown waits for it. W&B would do so at exit, but a training
        # process ends by os._exit (plait.launch.end_worker), which skips exit hooks.
        import wandb

        wandb.teardown()
