"""Checkpoints: seed checkpoints, distributed training checkpoints, exact resume.

A checkpoint is a folder written by `torch.distributed.checkpoint` (DCP) — each rank writes its
own shards, and any other layout can read them back (DCP reshards on load) — plus `plait.json`,
the manifest: model shape, step, data-loader and LR-schedule state, RNG state, and the sha256 of
every file (`digests.py`). The manifest (`manifest.py`) is written last, atomically, by rank 0 once every
rank's data is on disk, so a folder without one is never taken as complete: a crash mid-save can
leave debris, never a checkpoint. The folder may be a URL (s3://, gs://: plait/storage.py); an
asynchronous save then uploads in the background, and a save whose upload fails is never complete.

Nothing read here can run code: DCP's files are read through `safe_dcp.py`, everything
else is JSON. Every decision that changes which collectives a rank runs (which checkpoint to
resume, whether a step still needs saving) is rank 0's, sent to the others: ranks can see a
shared filesystem at different moments (NFS caches lookups), and must not act on their views.
"""

from __future__ import annotations

import base64
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from tokenizers import Tokenizer
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from plait import float8, hf, storage
from plait.checkpoint import digests, safe_dcp
from plait.checkpoint.digests import verify
from plait.checkpoint.manifest import (RESUMABLE, STEP_FOLDER, claim_folder, latest_complete, new_manifest,
                                       read_manifest, resumable_options, shown, write_manifest)
from plait.config import ConfigError, JobConfig
from plait.hf import tokenizer as hf_tokenizer
from plait.hf.tokenizer import TOKENIZER
from plait.hyperparameters import schedule
from plait.models.args import ModelArgs
from plait.models.transformer import Transformer, num_params
from plait.models.weights import fill_weights
from plait.optim.optimizers import group_options


def _cause(error: BaseException) -> str:
    """The first line of what went wrong; of DCP's exception, which wraps every rank's, the first rank's."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def from_rank0(value):
    """`value` as rank 0 has it, on every rank: what decides the collectives the ranks run next."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (a full disk, say): the run stops, nothing is lost silently."""


class Checkpointer:
    """Saves every `checkpoint.interval` steps and at the last, and restores at start-up (see `restore`)."""

    def __init__(self, cfg: JobConfig, args: ModelArgs, model, optimizer, scheduler, loader, identity: dict,
                 tokenizer: Tokenizer, extras: dict | None = None, ema=None):
        self.cfg, self.args, self.identity, self.tokenizer = cfg, args, identity, tokenizer
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.extras = extras or {}  # more state of the run (state_dict / load_state_dict) kept in the manifest
        self.ema = ema  # the weights' moving average (plait/ema.py), saved as DCP's `ema` beside the model
        self.root = storage.location(cfg.checkpoint.folder) if cfg.checkpoint.folder else None
        self.retries = storage.Retries() if self.root is not None and storage.is_remote(self.root) else None
        if self.root is not None and dist.get_rank() == 0:
            claim_folder(self.root, identity)  # start-up checked that no other job owns it
        self.companions: dict[str, bytes] = {}  # rank 0: files of the start folder every checkpoint keeps
        self.pending = None  # (future, folder, manifest) of an asynchronous save in flight
        self.saved_step = None  # the step this run last saved (or resumed): saving it again is a no-op
        self.newest = None  # the newest complete checkpoint this run saved or resumed (no listing: a store may be down)
        self.staging = None  # completes when the save in flight has copied the state it writes
        # Staging copies the state to CPU memory in a background thread while training goes on
        # (until the next optimizer step, see `wait_for_staging`), then it is written from there.
        # Pinned/shared memory and non-blocking copies need an accelerator.
        cuda = torch.cuda.is_available() and cfg.training.device != "cpu"
        self.stager = None
        if cfg.checkpoint.async_mode == "async":
            self.stager = DefaultStager(StagingOptions(cuda, cuda, True, cuda))
            # The background save runs collectives while training runs its own: a group of its
            # own keeps the two streams of collectives from interleaving on one communicator.
            self.save_group = dist.new_group(backend="gloo")
            self.hasher = ThreadPoolExecutor(1, thread_name_prefix="plait-digests")

    def _state(self, with_optimizer: bool, with_ema: bool = False) -> dict:
        state = {"model": get_model_state_dict(self.model)}
        if with_optimizer:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        if with_ema:
            state["ema"] = self.ema.state_dict()
        return float8.master_weights(state) if self.cfg.training.float8 != "none" else state

    def restore(self) -> int:
        """Resume from the newest complete checkpoint in checkpoint.folder (everything: weights,
        optimizer, schedule, data position, RNG, the weights' average) or else start from
        checkpoint.load (weights only: a seed checkpoint never carries data or optimizer state).
        Returns steps done. An average the checkpoint does not hold starts from its weights."""
        self.ema_loaded = False
        done = self._restore()
        if self.ema is not None and not self.ema_loaded:
            self.ema.restart()
        return done

    def _restore(self) -> int:
        choice = from_rank0(self._choose() if dist.get_rank() == 0 else None)
        if choice is None:
            return 0
        folder, manifest, resume = choice
        folder = storage.location(folder)
        if dist.get_rank() == 0:
            self.companions = hf_tokenizer.companions(folder, self.tokenizer)
        if not resume:
            if manifest is None:  # a Hugging Face folder
                state = hf.HFWeights(folder, self.args, "checkpoint.load")
                fill_weights(getattr(self.model, "module", self.model), lambda name, shape: state[name], state.buffers)
                if dist.get_rank() == 0:  # what was read, said once: the folder, its family and its size
                    with torch.device("meta"):
                        size = num_params(Transformer(self.args))
                    print(f"plait: loaded {folder}: {self.args.family}, {size / 1e6:,.1f}M parameters, "
                          f"{len(state.files)} tensors from {len(set(state.files.values()))} safetensors file(s)",
                          flush=True)
            else:
                self._load(folder, manifest, with_optimizer=False, option="checkpoint.load")
            return 0
        start = time.perf_counter()
        self._load(folder, manifest, with_optimizer=True, option="checkpoint.folder")
        self.saved_step, self.newest = manifest["step"], folder
        self.loader.load_state_dict(manifest["loader"])
        self.scheduler.load_state_dict(manifest["scheduler"])
        for key, extra in self.extras.items():  # (absent from an older plait's checkpoint: as a new run)
            extra.load_state_dict(manifest.get(key, {}))
        self._apply_hyperparameters(manifest.get("hyperparameters", {}))
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(manifest["rng"])), dtype=torch.uint8))
        if dist.get_rank() == 0:
            print(f"plait: resumed from {folder} (step {manifest['step']}) in {time.perf_counter() - start:.2f}s",
                  flush=True)
        return manifest["step"]

    def roll_back(self) -> Path | None:
        """Load the newest complete checkpoint's weights and optimizer state (and the weights'
        average), and nothing else: the
        data position, the schedule and the RNG go on from where the run is (training.spike_policy
        rollback: the steps since are undone, their data not seen again). None: no checkpoint yet."""
        self._finish_pending(block=True)  # (a save in flight is the newest once complete)
        choice = from_rank0(str(latest_complete(self.cfg.checkpoint.folder) or "") if dist.get_rank() == 0 else None)
        if not choice:
            return None
        folder = storage.location(choice)
        manifest = read_manifest(folder)
        self._load(folder, manifest, with_optimizer=True, option="checkpoint.folder")
        if self.ema is not None and not self.ema_loaded:
            self.ema.restart()
        self._apply_hyperparameters(manifest.get("hyperparameters", {}))
        return folder

    def _choose(self) -> tuple[str, dict | None, bool] | None:
        """Rank 0's choice of what start-up loads: (folder, its manifest, resume?), the newest
        complete checkpoint of checkpoint.folder, else checkpoint.load (no manifest: a Hugging
        Face folder); None for neither."""
        folder = latest_complete(self.cfg.checkpoint.folder)
        if folder is not None:
            return str(folder), read_manifest(folder), True
        load = self.cfg.checkpoint.load
        if not load:
            return None
        return load, None if hf.is_hf_folder(storage.location(load)) else read_manifest(storage.location(load)), False

    def _apply_hyperparameters(self, saved: dict) -> None:
        """Every hyper-parameter the optimizer steps with is this run's, on every rank: its
        groups come back from the checkpoint with the former values (and under pipeline
        parallelism on some ranks only: DCP drops the others' non-tensor entries, and the stages
        would step with different betas), so each group is rebuilt from this run's options; the
        schedule, a function of them (see plait/optim/schedule.py), continues from the resumed step.
        Rank 0 says which options differ from those the checkpoint recorded."""
        t, groups = self.cfg.training, self.optimizer.param_groups
        saved_lr = self.scheduler.get_last_lr()[0]  # (the step's lr the checkpoint was saved after)
        self.scheduler.base_lrs = [t.lr] * len(groups)
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group, options in zip(groups, group_options(self.cfg), strict=True):
            params = group["params"]
            group.clear()
            group.update({**self.optimizer.defaults, **options, "params": params, "initial_lr": t.lr, "lr": t.lr * factor})
        self.scheduler._last_lr = [group["lr"] for group in groups]
        changed = [f"{RESUMABLE[name]}.{name} {shown(saved[name])} -> {shown(value)}"
                   for name, value in resumable_options(self.cfg).items() if name in saved and saved[name] != value]
        if changed and dist.get_rank() == 0:  # and where that takes the lr: a schedule changes under the run
            done = self.scheduler.last_epoch
            print(f"plait: resuming with {', '.join(changed)} (this run's options; the checkpoint had the former): "
                  f"step {done + 1}'s lr {saved_lr:.3g} -> {groups[0]['lr']:.3g} ({schedule(self.cfg)}, {t.steps} "
                  "steps)", flush=True)

    def _load(self, folder: Path, manifest: dict, with_optimizer: bool, option: str) -> None:
        verify(folder, manifest, option, dist.get_rank(), dist.get_world_size())
        self.ema_loaded = with_optimizer and self.ema is not None and manifest.get("ema") is not None
        state = self._state(with_optimizer, with_ema=self.ema_loaded)
        try:
            safe_dcp.load(state, folder)
        except (Exception, CheckpointException) as e:
            raise ConfigError(f"checkpoint: loading {folder} failed: {_cause(e)}") from None
        set_model_state_dict(self.model, state["model"])
        if with_optimizer:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])

    def maybe_save(self, step: int) -> None:
        """Save every checkpoint.interval steps and at the last step; interval 0 saves the last
        step only (a checkpoint.folder given is a request for the trained model)."""
        interval = self.cfg.checkpoint.interval
        due = self.root is not None and (step == self.cfg.training.steps or (interval and not step % interval))
        try:
            self._finish_pending(block=False)
            if due:
                self._save(step, asynchronous=self.stager is not None)
        except SaveFailed as e:
            self._failed(e)

    def _failed(self, error: SaveFailed) -> None:
        """checkpoint.on_error: stop the run, or say why and train on (the next save tries again)."""
        self.saved_step = None
        if self.cfg.checkpoint.on_error == "stop":
            raise error
        if dist.get_rank() == 0:
            print(f"plait: {error}; training goes on (checkpoint.on_error continue): the next save tries again",
                  flush=True)

    def save_now(self, step: int) -> Path | None:
        """Save `step` synchronously, whatever the interval (preemption); None without checkpoint.folder."""
        if self.root is None:
            return None
        self._save(step, asynchronous=False)
        return self.root / f"step-{step}"

    def _save(self, step: int, asynchronous: bool) -> None:
        self._finish_pending(block=True)  # one save in flight at a time
        folder = self.root / f"step-{step}"
        if step == self.saved_step:
            return  # saved already (every rank knows: a signal on a checkpoint step, or the last)
        verdict = from_rank0(self._prepare(folder) if dist.get_rank() == 0 else None)
        if verdict == "complete":
            self.newest = folder
            return  # a complete checkpoint of this step exists: never overwrite a good one
        if verdict != "ready":  # (every rank fails alike: none waits in a collective for another)
            raise self._save_failed(folder, RuntimeError(verdict))
        self.saved_step = step
        manifest = new_manifest(self.cfg.model.flavor, self.args, "train", step, job=self.identity, loader=self.loader.state_dict(),
                             hyperparameters={**resumable_options(self.cfg), "optimizer": self.cfg.optimizer.name},
                             scheduler=self.scheduler.state_dict(),
                             **{key: extra.state_dict() for key, extra in self.extras.items()},
                             rng=base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
                             **({"ema": self.ema.decay} if self.ema is not None else {}))
        start = time.perf_counter()
        if not asynchronous:
            found, error = None, None
            try:
                dcp.save(self._state(with_optimizer=True, with_ema=self.ema is not None),
                         storage_writer=safe_dcp.writer(folder))
                found = self._digests(None, folder)
            except (Exception, CheckpointException) as e:
                error = e
            errors = [None] * dist.get_world_size()  # one rank's failure is every rank's
            dist.all_gather_object(errors, _cause(error) if error else None)
            if cause := next((e for e in errors if e), None):
                raise self._save_failed(folder, error or RuntimeError(cause))
            self._complete(folder, manifest, found, start, time.perf_counter() - start)
        else:
            response = dcp.async_save(self._state(with_optimizer=True, with_ema=self.ema is not None),
                                      storage_writer=safe_dcp.writer(folder),
                                      async_stager=self.stager, process_group=self.save_group)
            self.staging = response.staging_completion
            finished = self.hasher.submit(self._digests, response.upload_completion, folder)
            self.pending = (finished, folder, manifest, start, time.perf_counter() - start)

    @staticmethod
    def _prepare(folder: Path) -> str:
        """Rank 0's look at the folder a save is to write: complete already, or ready (debris of a
        save that never completed removed), or why it could not look (a server gone)."""
        try:
            if read_manifest(folder) is not None:
                return "complete"
            storage.remove_tree(folder)
            return "ready"
        except Exception as e:
            return _cause(e)

    def _digests(self, upload, folder: Path) -> dict[str, str] | None:
        """Once this rank's part of the save is on disk (`upload` done), hash it; on rank 0 wait
        for every rank's digests and return them all. (Rank 0 adds the run's tokenizer: a
        checkpoint keeps what it was trained with, so an export or `plait generate` needs no more.)"""
        if upload is not None:
            upload.result()
        if dist.get_rank() == 0:
            (folder / TOKENIZER).write_text(self.tokenizer.to_str(pretty=True))  # (as Tokenizer.save writes it)
            hf_tokenizer.write_companions(self.companions, folder)
        return digests.collect(folder, dist.get_rank(), dist.get_world_size(), self.cfg.comm.timeout_seconds)

    def wait_for_staging(self) -> None:
        """Call before anything changes parameters or optimizer state in place (the optimizer
        step): a save in flight may still be copying them, and would write a torn mix of steps."""
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def _finish_pending(self, block: bool) -> None:
        if self.pending is None or (not block and not self.pending[0].done()):
            return
        future, folder, manifest, start, blocking = self.pending
        self.pending = None
        self.wait_for_staging()
        try:
            found = future.result()
        except (Exception, CheckpointException) as e:
            raise self._save_failed(folder, e) from None
        self._complete(folder, manifest, found, start, blocking)

    def _save_failed(self, folder: Path, error: BaseException) -> "SaveFailed":
        """One line: the folder, why, what a checkpoint of this job needs and what is free there.
        The folder has no manifest, so nothing takes it as complete; older checkpoints stay."""
        with torch.device("meta"):
            elements = sum(p.numel() for p in Transformer(self.args).parameters())
        needed = 12 * elements  # parameters and both AdamW moments, in fp32
        free = storage.free_bytes(self.root)
        room = f" and {self.root} has {free / 2**20:,.0f} MiB free" if free is not None else \
            f" (its requests were retried {self.retries.count} times)" if self.retries and self.retries.count else ""
        return SaveFailed(f"checkpoint: saving {folder} failed ({_cause(error)}); a checkpoint of this job needs about "
                          f"{needed / 2**20:,.0f} MiB{room}; the unfinished folder has no manifest, the checkpoints "
                          "before it are intact")

    def _complete(self, folder: Path, manifest: dict, found: dict | None, start: float, blocking: float) -> None:
        # Rank 0 has every rank's digests, so every rank's files are on disk (and DCP's metadata,
        # which rank 0 writes last): only now is the manifest written.
        retried = ""
        if self.retries is not None and self.retries.count:  # (each rank's own requests: each says its own)
            retried = f"; rank {dist.get_rank()}'s requests to {self.root} were retried {self.retries.count} times"
            self.retries.count = 0
        if dist.get_rank() == 0:
            try:
                write_manifest(folder, {**manifest, "digests": found})
            except Exception as e:  # (rank 0's alone: the others go on, as checkpoint.on_error says)
                raise self._save_failed(folder, e) from None
            print(f"plait: checkpoint {folder} complete after {time.perf_counter() - start:.2f}s; training was "
                  f"blocked {blocking:.2f}s{retried}", flush=True)
            self._prune()
        elif retried:
            print(f"plait: checkpoint {folder}{retried}", flush=True)
        self.newest = folder

    def _prune(self) -> None:
        keep = self.cfg.checkpoint.keep_latest_k
        if not keep:
            return
        try:
            complete = sorted((int(STEP_FOLDER.match(p.name).group(1)), p) for p in self.root.iterdir()
                              if STEP_FOLDER.match(p.name) and read_manifest(p) is not None)
            for _, folder in complete[:-keep]:
                storage.remove_tree(folder)
        except Exception as e:  # (a store gone: the older checkpoints stay, complete; the next save prunes them)
            print(f"plait: removing checkpoints older than the newest {keep} from {self.root} failed: {_cause(e)}",
                  flush=True)

    def close(self) -> None:
        try:
            self._finish_pending(block=True)
        except SaveFailed as e:
            self._failed(e)
        if self.stager is not None:
            self.stager.close()
            self.hasher.shutdown()
