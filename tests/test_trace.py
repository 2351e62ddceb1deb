"""Profiler traces: `--profiling.enable` writes one Chrome trace per rank, and `plait trace` reads
from them which collectives each layout really ran, by phase and dtype."""

import pytest

from conftest import BF16, LAYOUTS as SHARED, STEPS, layout_run, run_plait
from plait.cli import main
from plait.proof.trace import summarise

LAYOUTS = {  # name: (world, options)
    "fsdp2": (2, ["--parallelism.dp_shard", "2"]),
    "ddp_bf16_reduce": (2, ["--parallelism.dp_replicate", "2", "--training.mixed_precision_reduce", "bfloat16"]),
    "tp": (2, ["--parallelism.tp", "2", "--parallelism.dp_shard", "1"]),
    "hsdp": (4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"]),
    "pp": (2, ["--parallelism.pp", "2"]),
    # classic DDP, two micro-batches per step (global 4 = micro 1 x dp 2 x accumulation 2), bf16 reduce
    "classic_ddp_accum2": (2, ["--parallelism.dp_backend", "ddp", "--parallelism.dp_replicate", "2",
                               "--training.mixed_precision_mode", "autocast", "--training.micro_batch_size", "1",
                               "--training.mixed_precision_reduce", "bfloat16"]),
}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """layout -> its trace folder: one profiled 2-rank run per layout, started on first use."""
    folders = {}

    def folder_of(layout: str):
        if layout not in folders:
            folder = tmp_path_factory.mktemp(layout) / "traces"
            folder.mkdir()
            (folder / "rank2.json").write_text("{}")  # left by an earlier, larger job: must go
            world, args = LAYOUTS[layout]
            run_plait(folder.parent, *args, *BF16, "--training.steps", "3", "--profiling.enable",
                      "--profiling.folder", str(folder), nproc=world)
            folders[layout] = folder
        return folders[layout]

    return folder_of


def trace(capsys, *argv):
    """`plait trace ARGV`: (exit code, stdout, stderr)."""
    code = main(["trace", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def expect_of_shared_bf16_run(train_once, capsys, layout: str, *expectations: str) -> None:
    """`plait trace --expect E ...` of the parity matrix's bf16 run of `layout` holds."""
    layout_run(train_once, layout, BF16)
    world, args = SHARED[layout]
    code, out, err = trace(capsys, train_once.traces[(world, (*STEPS, *args, *BF16))],
                           *(arg for e in expectations for arg in ("--expect", e)))
    assert code == 0, out + err


@pytest.mark.slow
def test_fsdp2_gathers_bf16_in_forward_and_reduce_scatters_fp32_in_backward(traces, capsys):
    folder = traces("fsdp2")
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.json", "rank1.json"]
    code, out, err = trace(capsys, folder, "--expect", "forward:all_gather:bf16",
                           "--expect", "backward:reduce_scatter:fp32", "--expect", "forward:!all_reduce",
                           "--expect", "backward:!all_reduce", "--expect", "optimizer:!all_gather")
    assert code == 0, out + err
    assert "2 rank(s) x 2 step(s)" in out and "5 expectation(s) hold on 2 rank(s)" in out
    rows = summarise(folder)
    assert {r["dtype"] for r in rows if (r["phase"], r["kind"]) == ("forward", "all_gather")} == {"bfloat16"}
    assert {r["dtype"] for r in rows if r["kind"] == "reduce_scatter"} == {"float32"}
    assert all(r["ranks"] == 2 and r["bytes_per_step"] for r in rows)


@pytest.mark.slow
def test_failed_expectations_exit_1_and_are_listed(traces, capsys):
    folder = traces("fsdp2")
    code, _, err = trace(capsys, folder, "--rank", 1, "--expect", "forward:all_gather:fp32",
                         "--expect", "backward:!reduce_scatter", "--expect", "optimizer:broadcast")
    assert code == 1
    assert err.splitlines() == [
        "plait trace: expectation failed: forward:all_gather:fp32: rank 1: ran only in bfloat16 x6",
        "plait trace: expectation failed: backward:!reduce_scatter: rank 1: ran 6 times",
        "plait trace: expectation failed: optimizer:broadcast: rank 1: did not run"]


@pytest.mark.slow
def test_ddp_all_reduces_in_backward_in_the_asked_reduce_dtype(traces, capsys):
    folder = traces("ddp_bf16_reduce")
    code, out, err = trace(capsys, folder, "--expect", "backward:all_reduce:bf16", "--expect", "forward:!all_gather",
                           "--expect", "backward:!reduce_scatter")
    assert code == 0, out + err
    # Every gradient collective travelled in bf16; gloo records the list-taking allreduce_ as
    # "TensorList", so this also proves the dtype was recovered from gloo's own event.
    assert {r["dtype"] for r in summarise(folder) if r["phase"] == "backward"} == {"bfloat16"}


@pytest.mark.slow
def test_pipeline_sends_activations_forward_and_gradients_back_in_bf16(traces, capsys):
    """PP2 (1f1b, 2 micro-batches): stage 0 sends each micro-batch's activations in forward and
    receives their gradients in backward; stage 1 the reverse. Nothing else crosses stages."""
    folder = traces("pp")
    code, out, err = trace(capsys, folder, "--rank", 0, "--expect", "forward:send:bf16=2", "--expect",
                           "backward:recv:bf16=2", "--expect", "forward:!recv", "--expect", "backward:!send")
    assert code == 0, out + err
    code, out, err = trace(capsys, folder, "--rank", 1, "--expect", "forward:recv:bf16=2", "--expect",
                           "backward:send:bf16=2", "--expect", "forward:!send", "--expect", "backward:!recv")
    assert code == 0, out + err


@pytest.mark.slow
def test_classic_ddp_reduces_once_per_step_not_per_micro_batch(traces, capsys):
    """DDP decides in forward whether backward reduces, so `no_sync` must span the forward of
    every micro-batch but the last: else each micro-batch all-reduces (and, with the bf16 hook,
    rounds already-averaged gradients to bf16 again). The debug model's gradients fill two DDP
    buckets (1 MiB in bf16): two all-reduces per step carrying every gradient exactly once."""
    import torch

    from plait.models.transformer import Transformer, num_params
    from plait.models.flavors import model_args

    folder = traces("classic_ddp_accum2")
    code, out, err = trace(capsys, folder, "--expect", "backward:all_reduce:bf16=2", "--expect", "forward:!all_reduce")
    assert code == 0, out + err
    with torch.device("meta"):
        gradient_bytes = 2 * num_params(Transformer(model_args("debug", 512)))
    [reduced] = [r for r in summarise(folder) if (r["phase"], r["kind"]) == ("backward", "all_reduce")]
    assert reduced["bytes_per_step"] == gradient_bytes
    code, _, err = trace(capsys, folder, "--expect", "backward:all_reduce=4")
    assert code == 1 and "ran 2 times per step" in err


@pytest.mark.slow
def test_hsdp_shards_within_and_all_reduces_across_replicas(traces, capsys):
    code, out, err = trace(capsys, traces("hsdp"), "--expect", "forward:all_gather:bf16",
                           "--expect", "backward:reduce_scatter:fp32", "--expect", "backward:all_reduce:fp32",
                           "--expect", "forward:!all_reduce")
    assert code == 0, out + err


@pytest.mark.slow
def test_tensor_parallel_communicates_in_forward_and_backward(traces, capsys):
    code, out, err = trace(capsys, traces("tp"), "--expect", "forward:all_gather:bf16",
                           "--expect", "forward:reduce_scatter:bf16", "--expect", "backward:all_gather:bf16",
                           "--expect", "backward:reduce_scatter:bf16")
    assert code == 0, out + err


@pytest.mark.slow
def test_context_parallel_gathers_keys_and_values_in_forward_and_reduce_scatters_them_in_bf16(train_once, capsys):
    """The parity matrix's CP2 bf16 run (debug model: 2 blocks; 2 micro-batches per step): every
    block all-gathers K and V in forward (bf16, beside FSDP2's parameter gathers) and reduce-scatters
    their gradients in backward in bf16, 2 x 2 x 2 = 8 calls per step, where FSDP2's gradient
    reduce-scatters are fp32."""
    expect_of_shared_bf16_run(train_once, capsys, "cp", "forward:all_gather:bf16", "backward:reduce_scatter:bf16=8",
                              "backward:reduce_scatter:fp32", "forward:!reduce_scatter")


@pytest.mark.slow
def test_ulysses_sends_heads_all_to_all_in_bf16_and_gathers_no_keys(train_once, capsys):
    """The parity matrix's Ulysses CP2 bf16 run (2 blocks, 2 micro-batches per step): every block
    sends q, k, v and the output all-to-all in forward and their gradients in backward, in bf16,
    2 x 2 x 4 = 16 calls each way; no keys or values are all-gathered: the only all-gathers are
    FSDP2's, one per unit and micro-batch in forward (3 units: 2 blocks and the root, x 2) and
    again for the first block in backward, and the only reduce-scatters its fp32 gradients."""
    expect_of_shared_bf16_run(train_once, capsys, "cp_ulysses", "forward:all_to_all:bf16=16",
                              "backward:all_to_all:bf16=16", "forward:all_gather:bf16=6", "backward:all_gather:bf16=2",
                              "backward:reduce_scatter:fp32", "forward:!reduce_scatter")


@pytest.mark.slow
def test_latent_attention_gathers_its_latents_under_cp_and_sums_partial_gradients_under_tp(train_once, capsys):
    """DeepSeek-V3's bf16 rows (debug_mla: 2 blocks and the MTP module's, 2 micro-batches per
    step). CP2: every block all-gathers its key latents and RoPE keys in bf16 (beside FSDP2's
    parameter gathers) and reduce-scatters their gradients in bf16, 2 x 3 x 2 = 12 calls per step;
    the sequence-wise loss sums each MoE layer's routing over cp in fp32 (2 layers x 2); FSDP2's
    gradients travel in fp32. TP2 (two micro-batches): sequence parallelism's gathers and
    scatters in bf16 both ways (per micro-batch 2 per block, 3 blocks with MTP's; the output
    layer's input gathered twice, MTP's too, the embedding's output scattered twice; a MoE block
    hands back its own part: no scatter), loss parallelism's 3 fp32 all-reduces per loss (the
    model's and MTP's), and in backward one all-reduce per partial gradient (the latents'
    projections and norms, the norms, MTP's projection), in the fp32 reduce dtype: the gradients
    accumulate over the micro-batches."""
    expect_of_shared_bf16_run(train_once, capsys, "cp_mla", "forward:all_gather:bf16",
                              "backward:reduce_scatter:bf16=12", "forward:all_reduce:fp32=4", "backward:reduce_scatter:fp32", "forward:!reduce_scatter")
    expect_of_shared_bf16_run(train_once, capsys, "tp_mla", "forward:all_gather:bf16=16",
                              "forward:reduce_scatter:bf16=12", "backward:all_gather:bf16=16",
                              "backward:reduce_scatter:bf16=12", "forward:all_reduce:fp32=12",
                              "backward:all_reduce:fp32=23")


@pytest.mark.parametrize("argv, fragment", [
    (["{tmp}/missing"], "does not exist"),
    (["{tmp}"], "no trace rank*.json"),
    (["{tmp}", "--expect", "forward:allgather"], "phases: forward, backward, optimizer, step; kinds: all_gather"),
    (["{tmp}", "--expect", "forward:!all_gather:bf16"], "is not phase:kind:dtype"),
    (["{tmp}", "--expect", "forward:all_gather:bf17"], "dtypes: bfloat16"),
    (["{tmp}", "--expect", "forward:!all_gather=2"], "optionally =N calls per step"),
    (["{tmp}/truncated"], "rank0.json is not a complete Chrome trace"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, fragment):
    (tmp_path / "truncated").mkdir()
    (tmp_path / "truncated" / "rank0.json").write_text('{"traceEvents": [')
    code, out, err = trace(capsys, *(a.format(tmp=tmp_path) for a in argv))
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("plait: error: ") and fragment in err
