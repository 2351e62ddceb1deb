"""Fault-tolerant data parallelism: replica groups that average gradients through torchft.

Each replica group is a torchrun job of its own, with the layout asked for inside it (FSDP2, TP, CP,
EP); torchft's Manager joins the groups into one more data-parallel dimension, across jobs. Every
step starts with a quorum at the lighthouse: the groups alive then take part, and a step commits
only where its cross-group all-reduces completed in every group that took part (otherwise it is
retried, on the same batches). A group that dies is left out of the next quorum and the others go
on with a smaller global batch: the dead group's share of those steps is not trained. (Re-queueing
it would make the data order depend on when failures happened, which no resumed run could replay.)
torchrun brings the group back (--max-restarts), and at its first quorum torchft heals it from a
live group, each rank from the same rank there (every group has the same layout): weights,
optimizer state, learning-rate schedule, data position and step. From then on its weights equal
the others' bitwise.

The cross-group average is FSDP2's all-reduce hook: it runs on each unit's reduce-scattered
gradient shard, in the reduce dtype, where HSDP's replicate all-reduce would run.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import urllib.parse
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from plait.config import ConfigError, JobConfig, replica_groups


def check_fault_tolerance(cfg: JobConfig) -> None:
    """The fault_tolerance options against each other and the layout; before any process group."""
    ft, p = cfg.fault_tolerance, cfg.parallelism
    if not ft.enable:
        return
    if ft.groups < 1 or not 0 <= ft.replica_id < ft.groups:
        raise ConfigError(f"fault_tolerance.replica_id: {ft.replica_id} must be in [0, groups={ft.groups}) "
                          "(and groups >= 1)")
    if not 1 <= ft.min_replicas <= ft.groups or ft.quorum_timeout_seconds < 1:
        raise ConfigError(f"fault_tolerance.min_replicas: {ft.min_replicas} must be in [1, groups={ft.groups}], "
                          f"and quorum_timeout_seconds >= 1 (got {ft.quorum_timeout_seconds})")
    if p.dp_backend != "fsdp2" or p.pp > 1 or p.dp_replicate > 1:
        raise ConfigError(f"fault_tolerance.enable: the replica groups average gradients in FSDP2's all-reduce hook; "
                          f"allowed inside a group: dp_backend fsdp2 with dp_shard, tp, cp, ep (got dp_backend "
                          f"{p.dp_backend}, pp {p.pp}, dp_replicate {p.dp_replicate}: the groups are the replicas)")
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError("fault_tolerance.enable: needs torchft, which is not installed: pip install 'plait[ft]'") \
            from None


def lighthouse(cfg: JobConfig) -> str:
    """The lighthouse the groups meet at: fault_tolerance.lighthouse, or $TORCHFT_LIGHTHOUSE; empty: none given."""
    return cfg.fault_tolerance.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")


def check_lighthouse(cfg: JobConfig) -> None:
    """The lighthouse is given and answers: checked on every rank before any process group (only
    rank 0 talks to it, and the others would wait for rank 0's Manager until a timeout)."""
    address = lighthouse(cfg)
    if not address:
        raise ConfigError("fault_tolerance.lighthouse: the groups need a lighthouse to meet at (http://HOST:PORT, or "
                          "$TORCHFT_LIGHTHOUSE; `plait lighthouse` runs one; `plait train` without torchrun starts one)")
    url = urllib.parse.urlsplit(address)
    try:
        socket.create_connection((url.hostname, url.port), timeout=10).close()
    except (OSError, TypeError, ValueError) as e:
        raise ConfigError(f"fault_tolerance.lighthouse: {address} does not answer ({e}); start one with "
                          "`plait lighthouse`, and give its http://HOST:PORT") from None


def own_paths(cfg: JobConfig) -> None:
    """Each group writes its own checkpoints, metrics and traces (`group-K` beside the names asked for):
    the groups are jobs of their own, and a whole-job restart resumes each from its own folder."""
    if not cfg.fault_tolerance.enable:
        return
    tag = f"group-{cfg.fault_tolerance.replica_id}"
    c, m = cfg.checkpoint, cfg.metrics
    c.folder = c.folder and os.path.join(c.folder, tag)
    m.tensorboard = m.tensorboard and os.path.join(m.tensorboard, tag)
    cfg.profiling.folder = os.path.join(cfg.profiling.folder, tag)
    for section, name in ((m, "jsonl"), (m, "plot"), (cfg.debug, "dtype_probe")):
        if path := getattr(section, name):
            stem, suffix = os.path.splitext(path)
            setattr(section, name, f"{stem}.{tag}{suffix}")


def quiet_torchft() -> None:
    """torchft's warnings and errors only (its Rust side logs every quorum and commit at INFO; its
    Python side warns on CPUs that it has no NCCL flight recorder to reset)."""
    os.environ.setdefault("RUST_LOG", "warn")
    logging.getLogger("torchft").setLevel(logging.ERROR)


class ReplicaGroups:
    """The steps of a run: each once, in order, without fault tolerance; torchft's otherwise."""

    def __init__(self, cfg: JobConfig):
        self.cfg, self.manager, self.healed = cfg, None, False
        self.waited = 0.0  # seconds the step's quorum took (a dead group's: until the lighthouse gives up on it)

    def start(self, model: nn.Module, state: dict, done: int, device: torch.device) -> None:
        """Join the lighthouse. `state`: what heals a group (name -> an object with state_dict and
        load_state_dict), sent by a live group rank by rank; `done`: the steps this group has."""
        if not self.cfg.fault_tolerance.enable:
            return
        quiet_torchft()
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        ft = self.cfg.fault_tolerance
        timeout = timedelta(seconds=self.cfg.comm.timeout_seconds)
        address, port = self._store(timeout)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=ft.min_replicas,
                               use_async_quorum=False, timeout=timeout,
                               quorum_timeout=timedelta(seconds=ft.quorum_timeout_seconds),
                               rank=dist.get_rank(), world_size=dist.get_world_size(), store_addr=address,
                               store_port=port, lighthouse_addr=lighthouse(self.cfg),
                               replica_id=f"plait_group_{ft.replica_id}")
        for name, part in state.items():
            self.manager.register_state_dict_fn(name, part.load_state_dict, part.state_dict)
        self.manager.load_state_dict({"step": done, "batches_committed": 0})
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(self.average)

    def _store(self, timeout: timedelta) -> tuple[str, int]:
        """A store of this attempt's own for the Manager, hosted by rank 0. (torchrun's outlives a
        restart, and a restarted rank could read the dead attempt's Manager address from it.)"""
        address = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if dist.get_rank() == 0:
            self.store = dist.TCPStore(address if address != "localhost" else "127.0.0.1", 0, is_master=True,
                                       wait_for_workers=False, timeout=timeout)
        port = [self.store.port if dist.get_rank() == 0 else 0]
        dist.broadcast_object_list(port, src=0)
        return address, port[0]

    def describe(self) -> str:
        ft = self.cfg.fault_tolerance
        return f", replica group {ft.replica_id} of {ft.groups} (torchft)" if ft.enable else ""

    def average(self, tensor: torch.Tensor) -> None:
        """Average `tensor` in place over the groups taking part in this step (a no-op without them)."""
        if self.manager is not None:
            self.manager.allreduce(tensor).wait()

    def steps(self, done: int, last: int) -> Iterator[int]:
        """The steps to run, from done + 1 to last. Under torchft each begins with a quorum (which
        heals this group first where it is behind: the step then continues the live groups'),
        and a step that did not commit comes again."""
        if self.manager is None:
            yield from range(done + 1, last + 1)
            return
        first = True
        while self.manager.current_step() < last:  # (not one more quorum after the last step: nobody may come)
            behind, asked = self.manager.current_step(), time.perf_counter()
            self.manager.start_quorum()
            if first:
                asked, first = self._gather(behind, asked), False
            self.waited = time.perf_counter() - asked
            step = self.manager.current_step() + 1
            self.healed = step - 1 != behind
            if step > last:
                return
            yield step

    POLL_SECONDS = 0.25  # between a waiting group's quorums (each of a lone group's returns at once)

    def _gather(self, behind: int, asked: float) -> float:
        """This group's first quorum takes every group (a whole job that starts or restarts from its
        checkpoints starts together, as an uninterrupted run would go on: a quorum of min_replicas
        would let the first group up train alone): the quorum is asked again until it holds every
        group, or healed this one (the others are ahead: a running job this group rejoins), or
        quorum_timeout_seconds have passed (then it goes on with the groups there, at least
        min_replicas; the others heal from them when they come). Returns when the last quorum was
        asked. (A count of polls, not a clock: every rank of the group decides alike.)"""
        ft, manager = self.cfg.fault_tolerance, self.manager
        polls = math.ceil(ft.quorum_timeout_seconds / self.POLL_SECONDS)
        for poll in range(polls + 1):
            if manager.num_participants() >= ft.groups or manager.current_step() != behind:
                return asked
            if poll == polls:
                break
            if poll == 0 and dist.get_rank() == 0:
                print(f"plait: replica group {ft.replica_id} waits for every replica group at its first step "
                      f"({manager.num_participants()} of {ft.groups} here; up to fault_tolerance."
                      f"quorum_timeout_seconds, {ft.quorum_timeout_seconds} s)", flush=True)
            time.sleep(self.POLL_SECONDS)
            asked = time.perf_counter()
            manager.start_quorum()
        if dist.get_rank() == 0:
            print(f"plait: warning: replica group {ft.replica_id}: {manager.num_participants()} of {ft.groups} groups "
                  f"came within {ft.quorum_timeout_seconds} s (fault_tolerance.quorum_timeout_seconds); going on "
                  f"with them (min_replicas {ft.min_replicas}): the others heal from them when they come", flush=True)
        return asked

    def commit(self) -> bool:
        """Whether the step may update the weights: every group of its quorum finished its all-reduces."""
        return self.manager is None or self.manager.should_commit()

    def taking_part(self) -> int:
        """Groups in this step's quorum (every group without fault tolerance)."""
        return self.manager.num_participants() if self.manager is not None else replica_groups(self.cfg)

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
