"""`plait doctor`: the whole command at world 2 (as a user launches it) and at world 4 numbered as
two machines of two ranks, with a fault injected into each of four ranks; each check must name
the rank at fault, and only the checks that should."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, launch
from plait.config import ConfigError, Parallelism
from plait.cli import main as plan_main
from plait.doctor import parse
from plait.doctor.job import job_config, reference_config
from plait.doctor.network import pairings
from plait.doctor.report import odd_ones
from plait.plan import model_shape
from plait.plan.calibration import from_doctor
from plait.plan.search import predict_job
from plait.models.masking import attention_kernel
from plait.parallel.stages import microbatches
from plait.precision import resolve

FAULTS = ROOT / "tests" / "faults"  # sitecustomize.py: faults injected from outside plait
# A short measuring budget: the tests are about verdicts, not about how well a CPU is measured.
QUICK = ["--budget_seconds", "4", "--training.threads", "1"]


def checks_of(path) -> dict[str, dict]:
    return {check["name"]: check for check in json.loads(path.read_text())["checks"]}


@pytest.mark.slow
def test_world_2_passes_every_check_and_cleans_up(tmp_path, capsys):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    proc = subprocess.run([sys.executable, "-m", "plait", "doctor", "--nproc", "2", *QUICK, "--json",
                           str(tmp_path / "doctor.json"), "--checkpoint.folder", str(folder)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "doctor.json").read_text())
    print(f"\ndoctor at world 2: {report['seconds']} s {report['seconds_per_area']}")
    assert report["ranks"] == 2 and report["nodes"] == 1 and report["job"] == "fsdp2: dp_shard 2"
    checks = checks_of(tmp_path / "doctor.json")
    assert set(checks) == {
        "hardware: versions", "hardware: devices", "compute: float32 matmul", "compute: bfloat16 matmul",
        "corruption: exact matmuls", "corruption: random matmuls", "corruption: training steps",
        *(f"network: {name} (world, 2 ranks)" for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")),
        "network: point-to-point latency", "training: losses", "training: throughput",
        "storage: write", "storage: read", "storage: free space"}
    # Speeds on a shared CPU may WARN; correctness never may.
    assert not [name for name, c in checks.items() if c["result"] == "FAIL"]
    for name in ("hardware: versions", "corruption: exact matmuls", "corruption: random matmuls",
                 "corruption: training steps", "training: losses", "storage: write", "storage: read"):
        assert checks[name]["result"] == "PASS", checks[name]
    # FSDP2 at world 2 averages two fp32 gradients, exact in either order: bitwise (test_parity).
    losses = checks["training: losses"]["values"]
    assert losses["losses"] == losses["one_device"] and len(losses["losses"]) == 6
    sizes = checks["network: all_reduce (world, 2 ranks)"]["values"]["sizes"]
    assert sizes[0]["bytes"] == 2**20 and sizes[0]["busbw"] == pytest.approx(sizes[0]["algbw"])  # 2(n-1)/n = 1
    # The report is a calibration plait plan reads, and the throughput row shows plan's prediction
    # for the doctor's own job from it: recomputed here from the file, it must be the same number.
    # How near the measured speed it comes is not asserted: the calibration and the job are timed
    # seconds apart, and the other test worker's load between them moved the ratio from 1.09x
    # (alone) to 2.14x (one CI run). docs/plan.md measures plan's accuracy on an idle machine.
    throughput = checks["training: throughput"]["values"]
    job = job_config(parse([*QUICK, "--checkpoint.folder", str(folder)]), 2)
    row = predict_job(model_shape(job), job, 2, float("inf"), from_doctor(str(tmp_path / "doctor.json")), 2)
    assert throughput["predicted_tokens_per_sec"] == pytest.approx(2 * row.tokens_per_second_per_device, rel=1e-12)
    assert throughput["tokens_per_sec"] > 0
    assert report["calibration"]["source"] == "plait doctor at world 2 on 1 node(s)"
    assert plan_main(["plan", "--world", "2", "--device_memory_gib", "1", "--calibration", str(tmp_path / "doctor.json"),
                      "--training.threads", "1", "--training.seq_len", "64", "--data.vocab_size", "512"]) == 0
    assert "plait doctor at world 2" in capsys.readouterr().out
    assert "plait doctor: PASS" in proc.stdout or "plait doctor: WARN" in proc.stdout
    assert list(folder.iterdir()) == []  # the doctor's checkpoint is gone, the folder stays


@pytest.mark.slow
def test_world_4_names_the_rank_of_each_fault(tmp_path):
    """Rank 0 cannot write past 1 MiB (a full disk), rank 1's matmuls return a last bit flipped,
    rank 2's take 4x their time, rank 3 runs another torch build; numbered as 2 machines x 2 ranks,
    so the collectives are measured within each node too."""
    proc = launch(["doctor", *QUICK, "--json", str(tmp_path / "doctor.json")], 4, timeout=300, nodes=2,
                  env={"PYTHONPATH": str(FAULTS), "PLAIT_TEST_FAULTS": "0:disk,1:bitflip,2:slow,3:version"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = checks_of(tmp_path / "doctor.json")
    verdicts = {name: (c["result"], c["ranks"]) for name, c in checks.items()}
    assert verdicts["hardware: versions"] == ("FAIL", [3])
    assert f"rank 3: torch {torch.__version__}.other" in checks["hardware: versions"]["measured"]
    assert verdicts["corruption: exact matmuls"] == ("FAIL", [1])
    assert verdicts["corruption: random matmuls"] == ("FAIL", [1])
    # Rank 2 is named and is the slowest. Four ranks share two cores here, beside another test's
    # job: a healthy rank can honestly measure under half the median too (rank 0 measured
    # 0.31x in one bf16 run), so what else is named is not asserted.
    for name in ("compute: float32 matmul", "compute: bfloat16 matmul"):
        assert verdicts[name][0] == "WARN" and 2 in verdicts[name][1], (name, checks[name])
        every = checks[name]["values"]["flops_per_rank"]
        assert every.index(min(every)) == 2, (name, every)
    assert verdicts["storage: write"] == ("FAIL", [0]) and "File too large" in checks["storage: write"]["measured"]
    for name in ("hardware: devices", "corruption: training steps", "training: losses"):
        assert verdicts[name] == ("PASS", []), (name, checks[name])
    network = [name for name in checks if name.startswith("network: ") and "latency" not in name]
    assert len(network) == 8 and all(verdicts[name][0] == "PASS" for name in network)
    assert sum("(within a node, 2 ranks)" in name for name in network) == 4
    assert "plait doctor: FAIL (hardware: versions, corruption: exact matmuls, corruption: random matmuls, " \
           "storage: write): not fit to train" in proc.stdout


def test_verdict_helpers_and_options():
    assert odd_ones(["a", "a", "b", "a"]) == [2]
    assert odd_ones(["a", "b"]) == [0, 1]  # two ranks that disagree: nothing says which is wrong
    assert odd_ones(["a"]) == []
    for world in (2, 3, 4, 7, 8):
        pairs = [pair for rounds in pairings(world) for pair in rounds]
        assert sorted(pairs) == [(a, b) for a in range(world) for b in range(a + 1, world)]
        assert all(len({r for pair in rounds for r in pair}) == 2 * len(rounds) for rounds in pairings(world))
    cfg = parse(["--budget_seconds", "30", "--training.steps", "3"])
    assert cfg.budget_seconds == 30 and cfg.training.steps == 3
    assert parse([]).training.steps == 6  # the doctor's short job, unless told otherwise
    with pytest.raises(ConfigError, match="budget_second: unknown option --budget_second; did you mean --budget_sec"):
        parse(["--budget_second", "3"])


MOE, DEEP, PP2 = ["--model.flavor", "debug_moe"], ["--model.n_layers", "4"], ["--parallelism.pp", "2"]
FP32 = ["--training.mixed_precision_param", "float32"]  # auto is bf16 on some CPUs, which classic DDP casts only
# under autocast: pinned, each job is valid on every machine (later flags win where a job asks for bf16)
# Valid jobs of more than one rank, as (world, options): between them every field of the parallelism
# section away from its default (the test below insists), and the options valid only with some layout.
LAYOUT_JOBS = [
    (2, ["--parallelism.dp_replicate", "2"]),
    (2, ["--parallelism.dp_shard", "2"]),
    (2, ["--parallelism.tp", "2", "--parallelism.no_sequence_parallel", "--parallelism.no_loss_parallel"]),
    (2, [*MOE, "--parallelism.ep", "2"]),
    (2, PP2),
    (2, [*PP2, *DEEP, "--parallelism.pp_schedule", "interleaved_1f1b", "--parallelism.pp_stages_per_rank", "2",
         "--parallelism.pp_microbatches", "8", "--parallelism.pp_split_points", "1", "2", "3"]),
    (2, [*PP2, *DEEP, "--parallelism.pp_schedule", "zbv"]),
    (2, ["--parallelism.cp", "2"]),
    (2, ["--model.flavor", "debug_mla", "--parallelism.cp", "2", "--parallelism.cp_gather", "expanded"]),
    (2, ["--parallelism.cp", "2", "--parallelism.cp_kind", "ulysses"]),
    (4, ["--parallelism.cp", "4", "--parallelism.cp_kind", "hybrid", "--parallelism.cp_ulysses", "2"]),
    (2, ["--parallelism.dp_backend", "ddp", "--parallelism.dp_replicate", "2", "--compile.autograd"]),
    (2, ["--parallelism.dp_backend", "ddp", "--parallelism.dp_replicate", "2", "--training.mixed_precision_param",
         "bfloat16", "--training.mixed_precision_mode", "autocast", "--training.mixed_precision_reduce", "bfloat16"]),
    (2, ["--parallelism.dp_backend", "simple_fsdp", "--parallelism.no_reshard_after_forward", "--compile.enable",
         "--compile.bucketing", "none", "--activation_checkpoint.mode", "selective"]),
    (4, [*MOE, "--parallelism.ep", "2", "--parallelism.dp_replicate", "2", "--training.micro_batch_size", "2"]),
    (4, [*MOE, *PP2, "--parallelism.cp", "2", "--parallelism.ep", "2", "--training.float8", "tensorwise"]),
    (8, [*PP2, "--parallelism.cp", "2", "--parallelism.tp", "2", "--parallelism.pp_schedule", "gpipe"]),
]


@pytest.mark.parametrize("world, options", LAYOUT_JOBS, ids=[" ".join(o) for _, o in LAYOUT_JOBS])
def test_reference_is_a_valid_one_device_job_of_every_layout(world, options):
    """The doctor's reference (the job alone on one device) of any job it accepts passes every
    start-up check at world 1, and trains what the job trains: the same model, precision, batch,
    sequences per forward and attention kernel, with no layout left but one device's."""
    job = job_config(parse([*FP32, *options]), world)
    reference = reference_config(job)  # check_options at world 1: a ConfigError fails the test here
    assert reference.parallelism == Parallelism(dp_shard=1)
    assert not reference.compile.autograd  # a ddp option: the one device runs eager autograd
    per_forward = job.training.micro_batch_size // (microbatches(job) if job.parallelism.pp > 1 else 1)
    assert reference.training == dataclasses.replace(job.training, micro_batch_size=per_forward)
    assert (reference.model.flavor, reference.model.n_layers, reference.data, reference.optimizer) == \
           (job.model.flavor, job.model.n_layers, job.data, job.optimizer)
    assert resolve(reference).compute == resolve(job).compute
    assert attention_kernel(reference) == attention_kernel(job)


def test_layout_jobs_set_every_parallelism_option():
    """A new parallelism option is reset by the reference's derivation (a fresh section) and tested
    above only when some job here sets it."""
    default = Parallelism()
    set_ = {f.name for _, options in LAYOUT_JOBS for f in dataclasses.fields(Parallelism)
            if getattr(parse(options).parallelism, f.name) != getattr(default, f.name)}
    assert set_ == {f.name for f in dataclasses.fields(Parallelism)}


def test_the_report_names_every_degree_of_the_layout():
    """ep borrows its ranks from dp_shard x cp, so no product of degrees shows it: said apart."""
    from plait.doctor import layout

    assert layout(job_config(parse([*FP32, *MOE, "--parallelism.ep", "2"]), 2)) == \
        "fsdp2: dp_shard 2, ep 2 (of dp_shard x cp)"
    assert layout(job_config(parse([*FP32, "--parallelism.tp", "2"]), 2)) == "fsdp2: tp 2"


def test_reference_keeps_the_kernel_auto_chose(monkeypatch):
    """On CUDA `auto` is sdpa under cp or pp and flex without them: the reference, which has neither,
    runs the job's kernel."""
    monkeypatch.setattr("plait.models.masking.pick_device", lambda _: torch.device("cuda"))
    job = job_config(parse([*FP32, "--parallelism.cp", "2"]), 2)
    assert attention_kernel(reference_config(job)) == attention_kernel(job) == "sdpa"


def test_auto_attention_is_sdpa_under_the_dtype_probe(monkeypatch):
    """FlexAttention trains compiled and the probe records eager ops (on an H200 a probed flex step
    failed in the compiler): on CUDA `auto` is flex for the document mask, sdpa once probed."""
    monkeypatch.setattr("plait.models.masking.pick_device", lambda _: torch.device("cuda"))
    assert attention_kernel(parse(FP32)) == "flex"
    assert attention_kernel(parse([*FP32, "--debug.dtype_probe", "probe.json"])) == "sdpa"


def test_the_throughput_row_says_when_a_gpu_waits_on_the_host():
    """On an H200 the doctor's debug job ran at MFU 0.1% and plan predicted it 4-7x too fast: the
    row says why there, and only there (a CPU, or a job that keeps the GPU busy, reads plainly)."""
    from plait.doctor.job import throughput_text

    waiting = "leaves the GPU waiting on the host"
    assert waiting in throughput_text(104_318, 0.001, 6, 442_492, gpu=True)
    assert waiting not in throughput_text(104_318, 0.001, 6, 442_492, gpu=False)
    assert waiting not in throughput_text(59_043, 0.399, 6, 64_830, gpu=True)
    assert throughput_text(479, 0.566, 6, 539, gpu=False) == \
        "479 tokens/s, MFU 56.6% (median of steps 2-6); plait plan predicts 539 (1.13x)"
