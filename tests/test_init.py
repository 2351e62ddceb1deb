"""Every layout starts from weights bitwise equal to the single-process init (meta-device build)."""

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
    """layouts: (dp_replicate, dp_shard, tp) each, built in turn in one process group."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from plait import parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        for dims in layouts:
            cfg = check_options(parse_args(["--parallelism.dp_replicate", str(dims[0]), "--parallelism.dp_shard",
                                            str(dims[1]), "--parallelism.tp", str(dims[2]), "--training.seed", "7"]),
                                world)
            mesh = parallel.build_mesh(cfg, "cpu")[0]
            model = parallel.build_model(model_args("debug", 500), mesh, cfg, resolve(cfg), torch.device("cpu"))
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            for name, value in reference.items():
                assert torch.equal(full[name], value), f"{dims} rank {rank}: {name} differs from the single-process init"
            assert torch.equal(model.rope, Transformer(model_args("debug", 500)).rope)
    finally:
        dist.destroy_process_group()


# (world, its layouts as (dp_replicate, dp_shard, tp)): one process group per world size
LAYOUTS = {2: [(1, 2, 1), (2, 1, 1), (1, 1, 2)], 4: [(2, 2, 1), (1, 2, 2), (2, 1, 2)]}


@pytest.mark.parametrize("world", LAYOUTS)
def test_sharded_init_equals_single_process_init(tmp_path, world):
    """Under TP a rank-local RNG would give every rank the same numbers for different heads
    (the heads would never diverge); comparing the gathered weights to the single-process
    init catches that."""
    reference_model = Transformer(model_args("debug", 500))
    init_weights(reference_model, seed=7)
    reference = reference_model.state_dict()
    mp.spawn(_check_layouts, args=(world, str(tmp_path / "store"), LAYOUTS[world], reference), nprocs=world)
