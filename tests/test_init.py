"""Every layout starts from weights bitwise equal to the single-process init (meta-device build)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from plait.arguments import parse_args
from plait.checks import check_options
from plait.models.transformer import Transformer
from plait.models.flavors import model_args
from plait.precision import resolve
from plait.models.weights import init_weights

pytestmark = pytest.mark.slow


def _check_layouts(rank, world, store_path, layouts, reference):
    """layouts: (dp_replicate, dp_shard, tp, offload) each, built in turn in one process group."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from plait import parallel

    torch.set_num_threads(1)
    os.environ["WORLD_SIZE"] = str(world)  # (what the precision reads: a world of one rank would skip fully_shard)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        for dims in layouts:
            argv = ["--parallelism.dp_replicate", str(dims[0]), "--parallelism.dp_shard", str(dims[1]),
                    "--parallelism.tp", str(dims[2]), "--training.seed", "7"]
            cfg = check_options(parse_args([*argv, "--training.offload", dims[3]]), world)
            mesh = parallel.build_mesh(cfg, "cpu")[0]
            model = parallel.build_model(model_args("debug", 500), mesh, cfg, resolve(cfg), torch.device("cpu"))
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            for name, value in reference.items():
                assert torch.equal(full[name], value), f"{dims} rank {rank}: {name} differs from the single-process init"
            assert torch.equal(model.rope, Transformer(model_args("debug", 500)).rope)
            if dims[3] != "none":
                _check_offloaded(model, cfg, mesh, check_options(parse_args(argv), world))
    finally:
        dist.destroy_process_group()


def _check_offloaded(model, cfg, mesh, plain_cfg):
    """On a CPU the host is the device, so this proves the wiring, not the saving: every unit
    fully_shard made keeps its shards off the device (CPUOffloadPolicy), and two steps (fused
    AdamW stepping host shards) equal the same layout's without offload. Bound: fused and torch's
    default AdamW round the update differently, by about an ulp of the weights (1.5e-8 measured on a
    toy FSDP2 model); 1e-6 leaves margin over two steps."""
    from torch.distributed.fsdp import FSDPModule

    from plait import parallel
    from plait.optim.optimizers import build_optimizer

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert len(units) == model.args.n_layers + 1
    assert all(p.offload_to_cpu for unit in units for p in unit._get_fsdp_state()._fsdp_param_group.fsdp_params)
    plain = parallel.build_model(model.args, mesh, plain_cfg, resolve(plain_cfg), torch.device("cpu"))
    tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    for m, c in ((model, cfg), (plain, plain_cfg)):
        optimizer = build_optimizer(m, c)
        for _ in range(2):
            m(tokens, labels=tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert (a.full_tensor() - b.full_tensor()).abs().max() < 1e-6, name


# (world, its layouts as (dp_replicate, dp_shard, tp, training.offload)): one process group per world size
LAYOUTS = {2: [(1, 2, 1, "none"), (2, 1, 1, "none"), (1, 1, 2, "none"), (1, 2, 1, "optimizer")],
           4: [(2, 2, 1, "none"), (1, 2, 2, "none"), (2, 1, 2, "none"), (1, 2, 2, "optimizer")]}


@pytest.mark.parametrize("world", LAYOUTS)
def test_sharded_init_equals_single_process_init(tmp_path, world):
    """Under TP a rank-local RNG would give every rank the same numbers for different heads
    (the heads would never diverge); comparing the gathered weights to the single-process
    init catches that."""
    reference_model = Transformer(model_args("debug", 500))
    init_weights(reference_model, seed=7)
    reference = reference_model.state_dict()
    mp.spawn(_check_layouts, args=(world, str(tmp_path / "store"), LAYOUTS[world], reference), nprocs=world)
