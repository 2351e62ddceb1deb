"""`plait bench`'s tables: the markdown of one invocation's rows, and the lines that compare rows
(float8, mixtures of experts, Muon, the framework tax against the raw loops)."""

from __future__ import annotations

import statistics

PP_MICROBATCHES = 4  # the pipeline rows' micro-batches
DTYPES = ("float32", "bfloat16")
# float8 row: the same layout without float8, the row its tokens/s are compared with.
FLOAT8_REFERENCES = {"single_float8": "single", "fsdp2_float8": "fsdp2", "fsdp2_float8_rowwise": "fsdp2",
                     "fsdp2_float8_compiled": "fsdp2_compiled", "fsdp2_mxfp8": "fsdp2"}
# Muon rows: the AdamW row of the same layout, whose optimizer step they are compared with.
MUON_REFERENCES = {"single_muon": "single", "fsdp2_muon": "fsdp2"}
# plait's row -> the loops it is held against (the framework tax: tokens/s over theirs, same precision).
TAX_REFERENCES = {"single": ("raw_pytorch", "transformers"), "fsdp2": ("raw_fsdp2", "fsdp2_untracked")}
# Other work's load average, in cores per core, from which the bench did not have the machine to itself.
BUSY = 0.5
# Rounds of a row whose tokens/s differ by more than this share of their median: the machine was noisy.
SPREAD = 0.2


def hardware_line(machine: dict) -> str:
    peaks = ", ".join(f"{dtype} {tflops:.3g}" for dtype, tflops in machine["peak_tflops"].items())
    return (f"hardware: {machine['device']} | native bf16: {'yes' if machine['native_bf16'] else 'no'} "
            f"({machine['why']}) | {machine['threads']} threads per single-device row | peak TFLOP/s of this "
            f"flavor's fastest linear layer: {peaks}")


def ac_cell(row: dict, dtype: str) -> str:
    if f"{dtype}_ac_saved_gib" not in row:
        return "-"
    return f"{row[f'{dtype}_ac_saved_gib']:+.2f} GiB saved, {row[f'{dtype}_ac_speed']:.2f}x tok/s"


def bubble_line(row: dict, dtype: str) -> str:
    """A pipeline row's measured idle share per rank (outside forward and backward: the bubble,
    plus the optimizer and bookkeeping every layout has) next to the schedule's ideal bubble."""
    stages = 2
    ideal = (stages - 1) / (PP_MICROBATCHES + stages - 1)
    idle = ", ".join(f"rank {rank} {100 * share:.0f}%" for rank, share in sorted(row[f"{dtype}_idle"].items()))
    return f"{row['layout']} {dtype}: idle {idle}; ideal bubble (p-1)/(m+p-1) = {100 * ideal:.0f}%"


def float8_lines(rows: list[dict], dtypes: list[str]) -> list[str]:
    """Each float8 row's tokens/s against the same layout without float8, per compute dtype."""
    by_key = {r["key"]: r for r in rows}
    lines = []
    for key, reference in FLOAT8_REFERENCES.items():
        if key in by_key and reference in by_key:
            ratios = ", ".join(f"{by_key[key][f'{d}_tokens_per_sec'] / by_key[reference][f'{d}_tokens_per_sec']:.2f}x "
                               f"({d})" for d in dtypes)
            lines.append(f"{by_key[key]['layout']} vs {by_key[reference]['layout']}: {ratios} tokens/s")
    return lines


def moe_lines(rows: list[dict], dtypes: list[str]) -> list[str]:
    """A mixture of experts' EP row and its dense twin against its FSDP2 row (tokens/s)."""
    by_key = {r["key"]: r for r in rows}
    if "fsdp2" not in by_key:
        return []
    return [f"{by_key[key]['layout']} vs FSDP2 (mixture of experts): " + ", ".join(
        f"{by_key[key][f'{d}_tokens_per_sec'] / by_key['fsdp2'][f'{d}_tokens_per_sec']:.2f}x ({d})" for d in dtypes)
        + " tokens/s" for key in ("ep", "dense_twin") if key in by_key]


def muon_lines(rows: list[dict], dtypes: list[str]) -> list[str]:
    """Each Muon row's optimizer step (rank 0, the profiled step) against AdamW's in the same layout."""
    by_key = {r["key"]: r for r in rows}
    return [f"{by_key[key]['layout']}: optimizer step " + ", ".join(
        f"{1e3 * by_key[key][f'{d}_optimizer_seconds']:.0f} ms vs AdamW's "
        f"{1e3 * by_key[reference][f'{d}_optimizer_seconds']:.0f} ms ({d})" for d in dtypes)
        for key, reference in MUON_REFERENCES.items() if key in by_key and reference in by_key]


def plan_lines(rows: list[dict], dtypes: list[str]) -> list[str]:
    """Each predicted row: plait plan's tokens/s from the doctor's calibration beside the measured."""
    lines = []
    for r in rows:
        cells = [f"{d} predicted {r[f'{d}_predicted_tokens_per_sec']:.0f}, measured {r[f'{d}_tokens_per_sec']:.0f} "
                 f"({r[f'{d}_tokens_per_sec'] / r[f'{d}_predicted_tokens_per_sec']:.2f}x)"
                 for d in dtypes if f"{d}_predicted_tokens_per_sec" in r]
        if cells:
            lines.append(f"plan: {r['layout']}: " + "; ".join(cells) + " tokens/s")
    return lines


def compiled_cell(row: dict, dtype: str) -> str:
    """A row's compiled tokens/s, its ratio to the same row eager and what the compiler did."""
    if f"{dtype}_compiled_tokens_per_sec" not in row:
        return "-"
    tokens = row[f"{dtype}_compiled_tokens_per_sec"]
    compiler = f", {row[f'{dtype}_compiled_graph_breaks']} graph breaks, {row[f'{dtype}_compiled_recompiles']} " \
        f"recompiles, {row[f'{dtype}_compiled_eager_fraction']:.0%} eager" if f"{dtype}_compiled_graph_breaks" in row \
        else ""  # (recompiles after step 2, eager: the step's time outside graphs; a raw loop has none counted)
    return f"{tokens:.0f} ({tokens / row[f'{dtype}_tokens_per_sec']:.2f}x{compiler})"


def tax_lines(rows: list[dict], dtypes: list[str]) -> list[str]:
    """plait's single device and FSDP2 against the raw loops of the same work: tokens/s over
    theirs per precision (eager; compiled too where measured). Below 1 is plait's overhead."""
    by_key = {r["key"]: r for r in rows}
    lines = []
    for key, references in TAX_REFERENCES.items():
        for reference in (r for r in references if key in by_key and r in by_key):
            ratios = [f"{by_key[key][f'{d}_{kind}tokens_per_sec'] / by_key[reference][f'{d}_{kind}tokens_per_sec']:.3f}x "
                      f"({d}{', compiled' * bool(kind)})" for d in dtypes for kind in ("", "compiled_")
                      if f"{d}_{kind}tokens_per_sec" in by_key[key] and f"{d}_{kind}tokens_per_sec" in by_key[reference]]
            lines.append(f"framework tax: {by_key[key]['layout']} vs {by_key[reference]['layout']}: "
                         + ", ".join(ratios) + " tokens/s")
    return lines


def markdown(result: dict) -> str:
    cfg = result["settings"]
    lines = []
    for flavor in dict.fromkeys(r["flavor"] for r in result["rows"]):
        rows, machine = [r for r in result["rows"] if r["flavor"] == flavor], result["hardware"][flavor]
        lines += [hardware_line(machine), "", f"flavor {flavor}, seq {cfg['seq_len']}, global batch {cfg['global_batch_size']}, "
                  f"median of steps {cfg['warmup'] + 1}-{cfg['steps']}"
                  + (f", then of {cfg['rounds']} rounds run in turn" if cfg.get("rounds", 1) > 1 else "")
                  + "; state = parameters + gradients + optimizer "
                  "state on rank 0; collectives per step on rank 0, loss and grad-norm reductions left out", ""]
        for dtype, short in zip(DTYPES, ("fp32", "bf16")):
            if dtype not in cfg.get("precisions", DTYPES):
                continue
            if dtype not in machine["dtypes"]:
                lines += [f"{short}: not measured, emulated on this device ({machine['why']}); "
                          "`plait bench --emulated_bf16 run` measures it anyway", ""]
                continue
            speedup = " vs fp32 |" if dtype == "bfloat16" and "float32" in machine["dtypes"] else ""
            compiled = " compiled tok/s |" if cfg.get("compile") else ""
            lines += [f"| layout | world | {short} tok/s |{compiled} MFU | vs raw |{speedup} peak mem GiB | state GiB/rank "
                      f"| collectives/step | AC vs FSDP2 |",
                      "|---|---|---|---|---|---|---|---|---|" + "---|" * (bool(speedup) + bool(compiled))]
            for r in rows:
                vs_raw, mfu = r[f"{dtype}_vs_raw"], r[f"{dtype}_mfu"]
                lines.append(f"| {r['layout']} | {r['world']} | {r[f'{dtype}_tokens_per_sec']:.0f} |"
                             + (f" {compiled_cell(r, dtype)} |" if compiled else "")
                             + f" {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | {'-' if vs_raw is None else f'{vs_raw:.2f}x'} |"
                             + (f" {r['bf16_speedup']:.2f}x |" if speedup else "")
                             + f" {r[f'{dtype}_memory_gib']:.2f} | {r[f'{dtype}_state_gib']:.3g} "
                             f"| {r[f'{dtype}_collectives_per_step']:g} | {ac_cell(r, dtype)} |")
            lines.append("")
        lines += [f"{s['layout']} state per rank / {s['reference']} state per rank at world {s['world']}: "
                  f"{s['ratio']:.2f}" for s in result["state_ratios"] if s["flavor"] == flavor]
        lines += [bubble_line(r, dtype) for r in rows for dtype in machine["dtypes"] if f"{dtype}_idle" in r]
        lines += float8_lines(rows, machine["dtypes"])
        lines += moe_lines(rows, machine["dtypes"])
        lines += muon_lines(rows, machine["dtypes"])
        lines += tax_lines(rows, machine["dtypes"])
        lines += plan_lines(rows, machine["dtypes"])
        lines.append("")
    return "\n".join(lines + trust_lines(result)).rstrip()


def trust_lines(result: dict) -> list[str]:
    """Warnings for under the table where its ratios cannot be trusted: other work on the machine
    while it ran (the load average beyond the bench's own ranks), or a row whose rounds disagree."""
    lines = []
    if load := result.get("load"):
        if max(load["start"], load["end"] - load["own"]) >= BUSY * load["cores"]:
            lines.append(f"warning: other work kept this machine busy (1-minute load average {load['start']:.1f} at "
                         f"the start, {load['end']:.1f} at the end, the bench's own ranks at most {load['own']}, on "
                         f"{load['cores']} cores): ratios between rows are not to be trusted; rerun on an idle machine")
    for row in result["rows"]:
        for metric, values in row.get("rounds_tokens_per_sec", {}).items():
            spread = (max(values) - min(values)) / statistics.median(values)
            if spread > SPREAD:
                lines.append(f"warning: {row['layout']}: its {len(values)} rounds differ by {spread:.0%} in "
                             f"{metric.removesuffix('_tokens_per_sec').replace('_', ' ')} tokens/s ({min(values):.0f} "
                             f"to {max(values):.0f}): a noisy machine; ratios with this row are uncertain")
    return lines
