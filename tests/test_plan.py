"""Activation checkpointing keeps the numerics and saves what it says, and `plait plan` predicts
what a run measures: state bytes exactly (the run's `state_gib`), saved activations within 5%
(the dtype probe's `saved_activations`), collective bytes by phase and kind exactly (`plait trace`
of the run).

Every run is shared (`train_once`): the parity matrix's runs are measured here at no extra cost,
and the activation-checkpointing runs below are the only new ones."""

import json

import pytest

from conftest import BF16, LAYOUTS, REPORTS, STEPS, TINY, layout_run, losses
from plait import plan
from plait.plan import comm, memory, parameters
from plait.cli import main
from plait.arguments import parse_args
from plait.checks import check_options
from plait.proof.trace import summarise
from test_parity import (CONTEXT_BF16, FAMILIES, FLOAT8, FLOAT8_BF16, MOE_BOUNDS, MUON_BOUNDS, MXFP8_BOUNDS,
                         PIPELINES_BF16, REFERENCE, SPMD_BF16, mode)

pytestmark = pytest.mark.slow
PRECISIONS = {"fp32": [], "bf16": BF16}
# Layouts whose runs plan predicts only in part, and why. A layout added to conftest.LAYOUTS
# without an entry here must be predicted in full, or this module fails.
PARTLY = {
    # SimpleFSDP gathers parameter by parameter and reshards by recomputing its blocks, which
    # plan does not model: it plans fully_shard (the default backend), which holds the same state.
    "simple_fsdp": {"state"}, "simple_hsdp_w4": {"state"}, "simple_fsdp_tp": {"state"}, "simple_fsdp_tied": {"state"},
    # Unsharded, SimpleFSDP's forward casts every parameter to bf16 and keeps the copies for
    # backward: memory plan counts as buffers, the probe (allocated in forward) as activations.
    "simple_ddp": {"state", "comm"}, "simple_ddp_tp": {"state", "comm"},
    # Classic DDP adds a 96-byte broadcast per step (its own bookkeeping) to what plan predicts.
    "classic_ddp": {"state", "activations"},
    # Float8 layers keep what linear layers keep for backward (their input, in the compute dtype):
    # plan predicts their activations (under FSDP2's float8 all-gather the probe also counts the
    # fp32 scales of the block FSDP2 prefetches for backward: 7 x 4 bytes). Under TP, each float8 cast of a TP-sharded tensor
    # all-reduces its amax (an fp64 scalar; tensorwise, debug model: 18 per micro-batch in
    # forward, 38 in backward, under 1 KiB a step), which plan does not count.
    **{name: {"state", "activations"} for name in FLOAT8 if name.startswith(("tp", "fsdp2_tp"))},
    "classic_ddp_f8": {"state", "activations"},  # and classic DDP's broadcast, as for classic_ddp
    # Mixtures of experts: plan predicts their state (each rank holds E / (dp_shard x cp) experts' worth
    # with or without ep), and on one device their activations and collectives too. Under ep what a
    # rank receives, keeps and sends back depends on the routing; under TP the layer runs whole on
    # the gathered sequence, which plan does not model yet.
    **{name: {"state"} for name in LAYOUTS if "moe" in name and not name.startswith("single")},
    # DeepSeek-V3's rows as the others': under ep what moves depends on the routing.
    "ep2_mla": {"state"}, "ep2_fsdp2_mla": {"state"},
    # gpt-oss's experts as the others' (on one device predicted in full: the clamped SwiGLU's
    # saved tensors and the biases' row indices included).
    **{name: {"state"} for name in LAYOUTS if "gpt_oss" in name and not name.startswith("single")},
    # (GLM-4.5's rows are named *_moe; Llama 4's experts, weighed on their inputs, as the others')
    **{name: {"state"} for name in LAYOUTS if "llama4" in name and not name.startswith("single")},
    # (Kimi Linear's blocks have experts too)
    **{name: {"state"} for name in LAYOUTS if "kimi" in name and not name.startswith("single")},
}
# Muon's rows as their AdamW layout's, less the step's collectives (its matrices' all-to-alls, or
# gathers), which plan does not count yet.
PARTLY |= {name: PARTLY.get(name.removesuffix("_muon").replace("_w4", ""), {"state", "activations", "comm"}) - {"comm"}
           for name in LAYOUTS if name.endswith("_muon")}
# Classic DDP cannot cast parameters: its bf16 run is autocast, whose casts plan does not model.
AUTOCAST_PARTS = {"state"}
ALL_PARTS = {"state", "activations", "comm"}
# The interleaved and V schedules run several stages per rank; how many micro-batches each holds
# at the first backward is predicted as an upper bound, and their receives are compared by kind.
BOUNDED = {"pp_interleaved_1f1b", "pp_interleaved_zb", "pp_zbv"}
# The bound. Every measured row is exact (ratio 1.0000) but those with linear-attention
# blocks, whose saved tensors plan counts from the code, not tensor by tensor as the probe sees
# them: 0.96-1.01 (one device, FSDP2, TP2, PP2, CP2; OLMo's hybrid; Qwen3-Next's gated experts).
ACTIVATION_TOLERANCE = 0.05

AC = ["--activation_checkpoint.mode"]
AC_RUNS = {  # (layout, precision, AC options); their reference is the same run without AC
    ("single", "fp32", "selective"): [*AC, "selective"],
    ("single", "fp32", "full"): [*AC, "full"],
    ("single", "bf16", "selective"): [*AC, "selective"],
    ("single", "bf16", "full"): [*AC, "full"],
    ("fsdp2", "fp32", "full"): [*AC, "full"],
    ("fsdp2", "bf16", "selective"): [*AC, "selective"],
    ("ddp_tp", "fp32", "selective"): [*AC, "selective"],
    ("ddp_tp", "bf16", "full"): [*AC, "full"],
    ("fsdp2_mx", "fp32", "full"): [*AC, "full"],
    ("single_deep", "fp32", "full every 2"): [*AC, "full", "--activation_checkpoint.every", "2"],
    ("cp", "fp32", "full"): [*AC, "full"],  # a checkpointed block gathers K/V again in backward
    ("cp_ulysses", "fp32", "full"): [*AC, "full"],  # ... or sends q, k, v and the output all-to-all again
    ("fsdp2_f8", "fp32", "full"): [*AC, "full"],  # recomputes float8 casts and gathers float8 again
    ("single_mla", "fp32", "selective"): [*AC, "selective"],  # latent attention's matmuls
    ("tp_mla", "bf16", "full"): [*AC, "full"],  # ... and its gathers under TP again
}


def measured_comm(train_once, key) -> dict[tuple[str, str], int]:
    """Rank 0's collective bytes per step by (phase, kind), over dtypes."""
    totals: dict[tuple[str, str], int] = {}
    for row in summarise(train_once.traces[key], rank=0):
        totals[row["phase"], row["kind"]] = totals.get((row["phase"], row["kind"]), 0) + row["bytes_per_step"]
    return totals


def by_kind(by_collective: dict[tuple[str, str], int]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for (_, kind), n in by_collective.items():
        totals[kind] = totals.get(kind, 0) + n
    return totals


def check(train_once, name: str, precision: str, extra: list[str] = ()) -> dict:
    """Plan against one shared run (rank 0); returns the numbers for the report."""
    world, args = LAYOUTS[name]
    autocast = mode(name, precision)
    options = [*STEPS, *args, *PRECISIONS[precision], *autocast, *extra]
    rows, probe = train_once(world, *options)
    cfg = check_options(parse_args([*TINY, *options]), world)
    model, stages = plan.model_shape(cfg), parameters.rank_stages(cfg, 0)
    p = cfg.parallelism
    layout = parameters.Layout(p.pp, p.dp_replicate, p.dp_shard, p.tp, p.cp)
    state = parameters.state_bytes(parameters.rank_parameters(model, cfg, stages), layout, cfg.optimizer.name)
    assert state / 2**30 == rows[0]["state_gib"], (name, precision, state)
    predicted = {"state": state}
    parts = PARTLY.get(name, {"state", "activations", "comm"}) & (AUTOCAST_PARTS if autocast else ALL_PARTS)
    e = 2 if precision == "bf16" else 4
    if "activations" in parts:
        saved = next(r["bytes"] for r in probe if r["kind"] == "saved_activations" and r["rank"] == 0)
        activations = memory.activation_bytes(model, cfg, stages, e)
        if name in BOUNDED:
            assert saved <= activations, (name, precision, saved, activations)
        else:
            assert abs(activations / saved - 1) <= ACTIVATION_TOLERANCE, (name, precision, saved, activations)
        predicted |= {"activations": activations, "saved": saved}
    if "comm" in parts:
        by_collective = {key: n for key, n in comm.comm_bytes(model, cfg, stages, e).items() if n}
        measured = measured_comm(train_once, (world, tuple(options)))
        if name in BOUNDED:  # receives run ahead of the chunks they serve: the trace's phase is a guess
            by_collective, measured = by_kind(by_collective), by_kind(measured)
        assert by_collective == measured, (name, precision, {k: (by_collective.get(k), measured.get(k)) for k in by_collective.keys() | measured.keys() if by_collective.get(k) != measured.get(k)})
        predicted["comm"] = sum(by_collective.values())
    return predicted


@pytest.fixture(scope="module")
def report():
    lines = ["run                               state B  activations: predicted  measured  ratio   comm B/step"]
    yield lines
    REPORTS["plait plan against measurement (rank 0)"] = "\n".join(lines)


def add_line(report, label: str, numbers: dict) -> None:
    ratio = f"{numbers['activations'] / numbers['saved']:.4f}" if "saved" in numbers else "-"
    report.append(f"{label:<33} {numbers['state']:>8}  {numbers.get('activations', '-'):>22}  "
                  f"{numbers.get('saved', '-'):>8}  {ratio:>6}  {numbers.get('comm', '-'):>12}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_plan_predicts_every_layout(train_once, report, name, precision):
    family_bf16 = {row for n, p in {**FAMILIES, **MOE_BOUNDS, **MUON_BOUNDS, **MXFP8_BOUNDS} if p == "bf16"
                   for row in (n, REFERENCE[n])}
    if precision == "bf16" and name not in [*SPMD_BF16, *PIPELINES_BF16, *CONTEXT_BF16, *FLOAT8_BF16, *family_bf16,
                                            "single", "single_f8"]:
        pytest.skip("no bf16 run of this layout in the shared matrix")
    add_line(report, f"{name} {precision}", check(train_once, name, precision))


@pytest.mark.parametrize("run", AC_RUNS, ids=lambda run: " ".join(run))
def test_activation_checkpointing_changes_memory_not_numerics(train_once, report, run):
    """Bitwise the losses of the same layout without AC, and the saved bytes plan predicts."""
    name, precision, label = run
    world, args = LAYOUTS[name]
    checkpointed = train_once(world, *STEPS, *args, *PRECISIONS[precision], *AC_RUNS[run])[0]
    plain = layout_run(train_once, name, PRECISIONS[precision])[0]
    assert losses(checkpointed) == losses(plain), run
    add_line(report, f"{name} {precision} AC {label}", check(train_once, name, precision, AC_RUNS[run]))


def saved_bytes(train_once, name: str, precision: str, extra=()) -> int:
    world, args = LAYOUTS[name]
    probe = train_once(world, *STEPS, *args, *PRECISIONS[precision], *extra)[1]
    return next(r["bytes"] for r in probe if r["kind"] == "saved_activations" and r["rank"] == 0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_saved_bytes_fall_from_none_to_selective_to_full(train_once, precision):
    none, selective, full = (saved_bytes(train_once, "single", precision, extra) for extra in
                             ([], [*AC, "selective"], [*AC, "full"]))
    REPORTS[f"saved activations, single device {precision} (bytes)"] = \
        f"none {none}  selective {selective} ({selective / none:.0%})  full {full} ({full / none:.0%})"
    assert none > selective > full


def test_full_checkpointing_adds_no_collectives_under_fsdp2(train_once):
    """Resharding already re-gathers each block's parameters for backward; recomputing the block
    happens after that gather, so the trace is the same call for call."""
    world, args = LAYOUTS["fsdp2"]
    for extra in ([], [*AC, "full"]):
        train_once(world, *STEPS, *args, *extra)
    plain, full = (train_once.traces[(world, (*STEPS, *args, *extra))] for extra in ([], [*AC, "full"]))
    strip = lambda rows: [{k: v for k, v in row.items() if k != "ranks"} for row in rows]
    assert strip(summarise(full)) == strip(summarise(plain))


def test_plan_lists_fitting_layouts_best_first_as_json(capsys):
    code = main(["plan", "--world", "4", "--device_memory_gib", "1", "--json", "--top", "0", *TINY])
    out = capsys.readouterr()
    result = json.loads(out.out)
    rows = result["rows"]
    assert code == 0 and "plan: best:" in out.err and "plan: run it: plait train --nproc 4 " in out.err
    assert {"layout", "activation_checkpoint", "micro_batch_size", "state_gib", "activations_gib", "buffers_gib",
            "total_gib", "comm_bytes", "fits", "step_seconds", "tokens_per_second_per_device", "mfu"} <= set(rows[0])
    assert {(r["layout"], r["activation_checkpoint"]) for r in rows} >= \
        {("dp_replicate=1,dp_shard=4,tp=1,pp=1", mode) for mode in plan.AC_MODES}
    assert all(r["fits"] for r in rows) and rows == sorted(rows, key=lambda r: r["step_seconds"])
    # every micro-batch size of the local batch, and cp, are searched; each row's speed is its step's
    assert {r["micro_batch_size"] for r in rows if r["layout"] == "dp_replicate=1,dp_shard=2,cp=2,tp=1,pp=1"} == {1, 2}
    assert any(",cp=2," in r["layout"] for r in rows)
    assert all(r["tokens_per_second_per_device"] == pytest.approx(4 * 64 / r["step_seconds"] / 4) for r in rows)
    # the header states what the numbers rest on: batch, precision, device and the source of its speeds
    header = result["assumptions"]
    assert "global batch 4 x seq 64 = 256 tokens" in header["batch"] and "float32" in header["precision"]
    assert "H100 SXM data sheet" in header["speeds"] and result["rows_total"] == len(rows)
    assert result["command"].startswith("plait train --nproc 4 --training.threads 1 ") and \
        f"--activation_checkpoint.mode {rows[0]['activation_checkpoint']}" in result["command"]


def test_plan_prints_the_top_rows_with_speed_and_the_command_of_the_best(capsys):
    """A table of --top rows, tokens/s per device and MFU columns; beyond one node, torchrun per node."""
    assert main(["plan", "--world", "16", "--device_memory_gib", "80", "--top", "3", *TINY]) == 0
    out = capsys.readouterr().out
    table = out.split("layout ")[1].split("(GiB per rank")[0].strip().splitlines()
    assert "tok/s/dev" in table[0] and "MFU" in table[0] and len(table) == 4
    assert "more rows: --top 0 prints them all" in out
    assert "plan: run it: torchrun --nnodes 2 --nproc-per-node 8 " in out and "-m plait train " in out


def test_the_command_of_the_best_row_names_each_option_once(capsys):
    """Options the layout sets replace the ones plan was given (torchrun's argv is not the place
    for a reader to guess which of two wins)."""
    assert main(["plan", "--world", "4", "--device_memory_gib", "80", *TINY, "--parallelism.cp", "2",
                 "--activation_checkpoint.mode=none"]) == 0
    command = capsys.readouterr().out.split("plan: run it: ")[1].splitlines()[0]
    for option in ("--parallelism.cp ", "--parallelism.dp_shard ", "--activation_checkpoint.mode "):
        assert command.count(option) == 1, command
    assert "--parallelism.cp 2 " in command and "--activation_checkpoint.mode=" not in command


def test_a_mixture_of_experts_plan_searches_ep_and_counts_its_all_to_alls(capsys):
    """ep splits the experts instead of FSDP2 gathering them: its rows trade expert all-gathers
    for token all-to-alls (balanced routing), which the plan counts."""
    assert main(["plan", "--world", "4", "--device_memory_gib", "80", "--json", "--top", "0", *TINY,
                 "--model.flavor", "debug_moe"]) == 0
    rows = {(r["layout"], r["activation_checkpoint"], r["micro_batch_size"]): r
            for r in json.loads(capsys.readouterr().out)["rows"]}
    plain = rows["dp_replicate=1,dp_shard=4,tp=1,pp=1", "none", 1]
    experts = rows["dp_replicate=1,dp_shard=4,tp=1,pp=1,ep=4", "none", 1]
    assert "forward all_to_all" not in plain["comm_by_collective"]
    # debug_moe: 2 MoE blocks, 2 x 64 tokens per micro-batch x top 2 x dim 128 x 4 bytes, out and back
    assert experts["comm_by_collective"]["forward all_to_all"] == 2 * 2 * 64 * 2 * 128 * 4
    assert experts["comm_by_collective"]["forward all_gather"] < plain["comm_by_collective"]["forward all_gather"]
    assert experts["state_gib"] == plain["state_gib"]  # E / (dp_shard x cp) experts' worth either way


def test_float8_is_timed_at_the_calibrations_float8_speed_with_its_casts():
    """Tensorwise float8 multiplies the blocks' linear layers at the float8 speed (twice bf16's on
    the data sheet) and pays their casts: faster than bf16, by less than 2x. A calibration without
    a float8 speed times those matmuls as bf16's, so only the casts remain: slower than bf16."""
    from dataclasses import replace

    from plait.plan.calibration import data_sheet
    from plait.plan.search import predict_job

    h100 = data_sheet("h100")
    unmeasured = replace(h100, matmul={k: v for k, v in h100.matmul.items() if k != "float8"})

    def step_seconds(cal, *flags):
        job = check_options(parse_args(["--model.flavor", "llama3_8b", "--training.seq_len", "8192",
                                        "--training.global_batch_size", "8", "--parallelism.dp_shard", "8",
                                        "--activation_checkpoint.mode", "selective", *flags]), 8)
        return predict_job(plan.model_shape(job), job, 8, 80.0, cal, 8).step_seconds

    bf16, float8 = step_seconds(h100), step_seconds(h100, "--training.float8", "tensorwise")
    assert 0.5 * bf16 < float8 < 0.95 * bf16
    assert step_seconds(unmeasured, "--training.float8", "tensorwise") > bf16
    assert "matmuls at up to 1,385 TFLOP/s" in plan.float8_timing("tensorwise", h100)
    assert "no float8 speed measured" in plan.float8_timing("tensorwise", unmeasured)
    assert "no MXFP8 speed measured" in plan.float8_timing("mxfp8", h100)


def test_offloading_moves_the_state_to_the_host_and_prices_the_host(capsys):
    """training.offload optimizer: the device holds no state, the host all of it (the same bytes);
    the host steps AdamW at its share of the node's rate; the copies hide behind compute while
    they are shorter. The search tries it where the calibration knows the host's link (a GPU's),
    and a job that gives offload is held to it."""
    from dataclasses import replace

    from plait.plan.calibration import data_sheet
    from plait.plan.search import predict_job

    h100 = data_sheet("h100")

    def row(*flags, world=8, cal=h100):
        job = check_options(parse_args(["--model.flavor", "llama3_8b", "--training.seq_len", "8192",
                                        "--training.global_batch_size", str(world), *flags]), world)
        return predict_job(plan.model_shape(job), job, world, 80.0, cal, 8, host_memory_gib=2048.0)

    kept, offloaded = row(), row("--training.offload", "optimizer")
    assert offloaded.state_gib == 0 and offloaded.host_gib == pytest.approx(kept.state_gib, rel=1e-12)
    assert offloaded.activations_gib == kept.activations_gib
    elements = kept.state_gib * 2**30 / 16  # (fp32 weight, gradient and two moments: 16 bytes an element)
    assert offloaded.optimizer_seconds == pytest.approx(elements * 8 / h100.host_step, rel=1e-3)
    slow_link = row("--training.offload", "optimizer", cal=replace(h100, host_link=1e9))
    assert slow_link.communication_seconds > offloaded.communication_seconds + 1  # (no longer hidden)
    # one H100: llama3_8b's 120 GiB of state fits only on the host; a host of 100 GiB refuses it
    code = main(["plan", "--world", "1", "--device_memory_gib", "80", "--model.flavor", "llama3_8b",
                 "--training.seq_len", "8192", "--training.global_batch_size", "4"])
    out = capsys.readouterr().out
    assert code == 0 and "offload optimizer (119.66 GiB of host memory per rank)" in out
    assert "--training.offload optimizer" in out.split("plan: run it:")[1]
    for flags in (["--training.offload", "none"], ["--host_memory_gib", "100"]):
        assert main(["plan", "--world", "1", "--device_memory_gib", "80", "--model.flavor", "llama3_8b",
                     "--training.seq_len", "8192", "--training.global_batch_size", "4", *flags]) == 1
        assert "fits nowhere" in capsys.readouterr().out
    # no host link known (a CPU, or a doctor's file from before it measured one): no offload rows
    assert main(["plan", "--world", "2", "--device_memory_gib", "80", "--device", "cpu", "--json", *TINY]) == 0
    assert {r["offload"] for r in json.loads(capsys.readouterr().out)["rows"]} == {"none"}


def test_calibrations_and_their_errors(tmp_path, capsys):
    from plait.config import ConfigError
    from plait.plan.calibration import at, data_sheet, here, load

    h100 = data_sheet("h100")
    assert h100.peak["bfloat16"] == 989.5e12 and not h100.elementwise
    cpu = here(seconds=0.5)  # --device cpu: this machine's compute measured now, gloo's links stated
    assert "measured here now" in cpu.source and not cpu.asynchronous and cpu.op_seconds > 0
    assert all(rate > 0 for curve in cpu.matmul.values() for _, rate in curve) and cpu.cores >= 1
    assert at([(1.0, 1.0), (100.0, 100.0)], 10.0) == pytest.approx(10.0)  # log-log between points, flat beyond
    assert at([(1.0, 1.0), (100.0, 100.0)], 1e6) == 100.0
    with pytest.raises(ConfigError, match="device: 'tpu' unknown; allowed: h100, h200, b200, cpu"):
        load("tpu", "")
    (tmp_path / "bad.json").write_text("{}")
    assert main(["plan", "--world", "2", "--device_memory_gib", "1", "--calibration", str(tmp_path / "bad.json"),
                 *TINY]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a plait doctor --json report" in err


def test_plan_says_what_would_be_needed_when_nothing_fits(capsys):
    code = main(["plan", "--world", "2", "--device_memory_gib", "0.001", *TINY])
    out = capsys.readouterr().out
    assert code == 1 and "fits nowhere" in out and "GiB per rank" in out


def test_plan_refuses_a_world_no_layout_divides(capsys):
    code = main(["plan", "--world", "3", "--device_memory_gib", "80", *TINY])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no layout of 3 ranks" in err


def test_the_manual_shows_what_plan_prints(capsys):
    """docs/plan.md's example is this command's output (the data sheet's numbers: no machine in it)."""
    from conftest import ROOT

    page = (ROOT / "docs" / "plan.md").read_text()
    command = page.split("```bash\n")[1].splitlines()[0].split()
    assert command[:2] == ["plait", "plan"] and main(command[1:]) == 0
    shown = page.split("regenerates it and fails if this page drifts):\n\n```text\n")[1].split("\n```")[0]
    assert shown == capsys.readouterr().out.rstrip()


@pytest.mark.parametrize("given", [["--parallelism.tp", "2"], ["--parallelism.pp", "2", "--parallelism.dp_shard", "1"],
                                   ["--parallelism.tp", "1", "--parallelism.dp_replicate", "2"]])
def test_every_degree_given_is_held_fixed(given, capsys):
    """A degree on the command line (or in the config) is the user's decision: every row has it,
    an explicit 1 included; the others are searched (issue 62: tp was ignored)."""
    assert main(["plan", "--world", "8", "--device_memory_gib", "80", "--json", "--top", "0", *TINY, *given]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    held = {f"{name[len('--parallelism.'):]}={value}" for name, value in zip(given[::2], given[1::2])}
    assert rows and all(held <= set(r["layout"].split(",")) for r in rows), {r["layout"] for r in rows}
    assert len({r["layout"] for r in rows}) > 1  # (the rest still searched)


@pytest.mark.parametrize("given, message", [
    (["--parallelism.tp", "3"], "parallelism.tp: 3 does not divide the world of 8 ranks; allowed: 1, 2, 4, 8 (or "
                                "leave it out: plan searches it)"),
    (["--parallelism.tp", "4", "--parallelism.pp", "4"], "parallelism: pp 4 x tp 4 = 16 ranks do not divide the "
                                                         "world of 8")])
def test_degrees_that_cannot_make_the_world_are_refused_in_one_line(given, message, capsys):
    assert main(["plan", "--world", "8", "--device_memory_gib", "80", *TINY, *given]) == 2
    assert capsys.readouterr().err.splitlines() == [f"plait: error: {message}"]


def test_a_batch_left_at_the_debug_job_s_is_said_and_written_into_the_command(capsys):
    """An 8B planned on the debug job's 16 x 128 tokens: a warning, and the command carries the
    batch the rows assumed (the run is the plan's)."""
    assert main(["plan", "--world", "8", "--device_memory_gib", "80", "--model.flavor", "llama3_8b", "--top", "1"]) == 0
    out = capsys.readouterr()
    assert "plait: warning: left at the debug job's defaults (picked for a 1.4M-parameter model on the bundled " \
           "corpus, not for llama3_8b): training.seq_len 128, training.global_batch_size 16; the plan is for them" \
           in out.err
    assert "--training.seq_len 128 --training.global_batch_size 16 " in out.out.split("plan: run it: ")[1]


def test_a_calibration_from_too_short_a_budget_is_marked_and_plan_says_so(tmp_path, capsys):
    """issue 62: `plait doctor --budget_seconds 5` measured fp32 at its smallest size only and
    passed that speed to plan unmarked."""
    from dataclasses import asdict

    from plait.plan.calibration import data_sheet, short_curves

    full = [(2.0 * n**3, 1e12) for n in (128, 256, 512, 1024)]
    assert short_curves({"float32": full, "bfloat16": full[:2]}, gpu=False) == \
        "bfloat16 at n=128, 256 only (of 128..1024)"
    numbers = {**asdict(data_sheet("h100")), "short": short_curves({"float32": full[:1]}, gpu=False)}
    (tmp_path / "doctor.json").write_text(json.dumps({"calibration": numbers}))
    assert main(["plan", "--world", "2", "--device_memory_gib", "80", "--calibration", str(tmp_path / "doctor.json"),
                 *TINY]) == 0
    assert f"plan: warning: calibration {tmp_path / 'doctor.json'}: matmuls measured float32 at n=128 only (of " \
           "128..1024): the speeds below understate the device; rerun plait doctor with a longer --budget_seconds" \
           in capsys.readouterr().err
