"""torch.compile per transformer block, and compiled autograd, against eager.

Compiled and eager runs are not bitwise equal: inductor fuses element-wise chains and keeps
their intermediates in fp32 registers where eager rounds each op's output to bf16. The bounds
below are a few times the differences measured over 6 steps (stated per test).

Measured by hand, no row (the suite's 35 minutes): Ulysses CP2 bitwise (its all-to-alls in the
graph); DeepSeek-V3 under CP2 bitwise, no break; Qwen3-Next under TP2 bitwise, no break, but 200 s of compiling;
Gemma 3 under TP2 (SP: the norms after the sub-layers on the sequence shard, zero-centred norms,
the scaled embedding, GeGLU, RoPE by block kind in the graphs) 4.8e-7, 50 s of compiling; MXFP8
under FSDP2 in fp32 (emulated here: each block's scale, cast to e4m3 and back, fused by inductor;
a value one ulp off can cross an e4m3 rounding boundary, as for float8) 5.7e-6, no break, 86 s of
compiling cold (23 kernels' C++ on this CPU, where MXFP8's real kernels are CUDA's).
"""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import (AUTOCAST, BF16, LAYOUTS, STEPS, TASK, VALIDATE, layout_run, losses, max_abs_diff, run_plait,
                      validation_text)
from plait import parallel
from plait.arguments import parse_args
from plait.checks import check_options
from plait.models.flavors import model_args
from plait.precision import TrainContexts, resolve
from plait.proof.trace import eager_fraction

pytestmark = pytest.mark.slow
AC_FULL = ["--activation_checkpoint.mode", "full"]
CLASSIC_DDP = ["--parallelism.dp_backend", "ddp", "--parallelism.dp_replicate", "2",
               "--training.mixed_precision_mode", "autocast"]


# The layouts whose compiled runs evaluate too (after steps 3 and 6: the evaluation's graphs are
# compiled once, at step 3's, none at step 6's), each its own evaluation path: one device, the
# pipeline's, TP's (the loss over vocabulary shards), CP's. Under FSDP2 and DDP an evaluation is
# the one device's forward: compiling its graphs cost a third of a row's time, cold.
EVALUATED = ("single", "pp", "tp", "cp")


@pytest.mark.parametrize("layout, precision, mode, tolerance", [
    ("single", [], [], 1e-6),  # measured: bitwise equal
    ("fsdp2", BF16, [], 2e-3),  # measured 4.6e-4 (6.1e-4 single device)
    ("classic_ddp", BF16, AUTOCAST, 2e-3),  # measured 1.2e-4 (1.7e-4 single device autocast)
    ("pp", [], [], 1e-6),  # PP2 1f1b, blocks compiled inside the stages: measured 4.8e-7
    # TP2 (SP, loss parallel): the embedding's output reaches the compiled first block as an
    # AsyncCollectiveTensor, which left the embedding without gradient (5.1e-3 after 6 steps,
    # grad norm 0.4% low from step 1) until the block waited on it: measured 4.8e-7
    ("tp", [], [], 1e-6),
    # activation checkpointing inside the compiled blocks (eager side: the run without AC, bitwise the same)
    ("fsdp2", [], AC_FULL, 1e-6),
    # CP2: the K/V all-gather (functional collectives) and the query blocks inside the graph: measured bitwise
    ("cp", [], [], 1e-6),
    # float8 tensorwise under FSDP2 (float8 all-gather), fp32: inductor fuses each cast's amax, scale
    # and rounding into one kernel; a scale one ulp off moves a few values across a float8
    # rounding boundary: measured 9.5e-6, bound 10x
    ("fsdp2_f8", [], [], 1e-4),
    # a mixture of experts as one graph per block: its counts scattered (not bincount's data-sized
    # output), its fp32 grouped matmuls plait's own operator (plait/models/expert_matmul.py).
    # Measured bitwise (GLM-4.5's under FSDP2, by hand: 4.8e-7, one ulp of the loss)
    ("single_moe", [], [], 1e-6),
    # EP2: the experts' blocks compiled by regions around the experts' FSDP2 unit and the
    # all-to-alls, the experts' own work one graph of a dynamic token count; under full AC, whose
    # recomputation meets the all-to-all's wait (measured 4.8e-7 with or without AC)
    ("ep2_moe", [], AC_FULL, 1e-6),
], ids=["single-fp32", "fsdp2-param", "ddp-autocast", "pp2-fp32", "tp2-fp32", "fsdp2-fp32-ac-full", "cp2-fp32",
         "fsdp2-float8", "single-moe-fp32", "ep2-moe-ac-full"])
def test_compiled_blocks_match_eager(tmp_path, train_once, layout, precision, mode, tolerance):
    # The eager run, shared with the parity tests; activation checkpointing changes no eager loss
    # (bitwise: test_plan's AC runs), so an AC row's reference is its layout's run without it.
    eager, _ = layout_run(train_once, layout, precision, [] if mode == AC_FULL else mode)
    world, args = LAYOUTS[layout]
    (tmp_path / "val.txt").write_text(validation_text())  # (evaluations after steps 3 and 6, as the eager run's)
    validate = [*VALIDATE, *TASK, "--data.val_path", str(tmp_path / "val.txt")] if layout in EVALUATED else []
    # (one device's runs profile their step 4: the bench's share of a step outside compiled graphs)
    profiled = ["--profiling.enable", "--profiling.start_step", "4", "--profiling.steps", "1", "--profiling.folder",
                str(tmp_path / "trace")] if world == 1 else []
    compiled, _ = run_plait(tmp_path, *STEPS, *args, *precision, *mode, *validate, *profiled, "--compile.enable",
                            "--compile.report", str(tmp_path / "compiled.json"), nproc=world)
    diff = max_abs_diff(losses(eager), losses(compiled))
    print(f"\ncompiled vs eager, {layout} {' '.join(precision + mode) or 'fp32'}: max |loss diff| {diff:.2e}")
    assert diff <= tolerance
    # what the compiler did, every rank: no graph break, nothing
    # compiled again after step 2 (an evaluation's no-gradient graph is compiled once, listed apart)
    for rank in range(world):
        report = json.loads((tmp_path / f"compiled.rank{rank}.json").read_text())
        assert report["graph_breaks"] == [], report
        assert report["recompiles_after_step_2"] == [], report
        assert {graph["step"] for graph in report["evaluation_graphs"]} == ({3} if validate else set()), report
    if profiled:  # the blocks' and the loss's graphs ran in the step, and so did eager work (the optimizer's)
        assert 0 < eager_fraction(tmp_path / "trace") < 1


def _compiled_autograd_ddp(rank, world, store_path, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        grads = {}
        for compiled in (False, True):
            cfg = check_options(parse_args([*CLASSIC_DDP, "--compile.enable" if compiled else "--compile.no_enable",
                                       "--compile.autograd" if compiled else "--compile.no_autograd"]), world)
            mesh = parallel.build_mesh(cfg, "cpu")[0]
            precision = resolve(cfg)
            model = parallel.build_model(model_args("debug", 500), mesh, cfg, precision, torch.device("cpu"))
            contexts = TrainContexts(precision, "cpu", compiled_autograd=compiled)
            tokens = torch.randint(0, 500, (2, 33), generator=torch.Generator().manual_seed(rank))  # rank-local data
            with contexts.forward():
                loss = model(tokens[:, :-1], labels=tokens[:, 1:])
            with contexts.backward():
                loss.backward()
            grads[compiled] = torch.cat([p.grad.flatten() for p in model.parameters()])
        # Reduction happened under compiled autograd: every rank holds the same averaged gradient ...
        gathered = [torch.empty_like(grads[True]) for _ in range(world)]
        dist.all_gather(gathered, grads[True])
        assert all(torch.equal(g, gathered[0]) for g in gathered)
        # ... and it is the eager DDP gradient (compiled autograd changes the backward's fusion only).
        results[rank] = (grads[True] - grads[False]).abs().max().item() / grads[False].abs().max().item()
    finally:
        dist.destroy_process_group()


def test_compiled_autograd_reduces_gradients_under_ddp(tmp_path):
    """The trap behind refusing it with FSDP2: compiled autograd can skip gradient reduction
    silently. Under DDP (Python reducer) the gradients must still arrive reduced."""
    results = mp.Manager().dict()
    mp.spawn(_compiled_autograd_ddp, args=(2, str(tmp_path / "store"), results), nprocs=2)
    print(f"\ncompiled autograd vs eager DDP: max relative gradient difference {max(results.values()):.2e}")
    assert max(results.values()) < 2e-2
