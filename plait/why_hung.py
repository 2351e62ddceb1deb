"""`plait why-hung FOLDER`: which rank is behind, and on which collective, from the dumps of every
rank's last collectives (plait/collectives.py) in FOLDER/collectives (FOLDER: the job's
checkpoint.folder, else the folder of its metrics.jsonl, else the one it ran in).

Per process group, the ranks' collectives are lined up by their sequence number (every rank of a
group numbers its collectives on it alike):
1. the first number at which ranks called different collectives (another op, other sizes where
   sizes must agree, or the same op from another line of plait) is where they went apart: each
   side is named, with the line that called it;
2. else, where a rank had been in its last collective for WAITED_S (or half the timeout) when it
   dumped, the rank(s) whose last collective is the lowest are behind, and the others wait in the
   next one, which is named. Otherwise no rank is behind: ranks a collective or two apart are a
   run in flight, caught by a signal at slightly different moments.
A rank without a dump is named too (dead, or it never reached a timeout or the signal).
"""

from __future__ import annotations

import json
from pathlib import Path

from plait.config import ConfigError

SAME_SIZES = ("all_reduce", "allreduce", "broadcast", "all_gather", "allgather", "reduce_scatter")
WAITED_S = 10.0  # a rank in one collective this long (or half its timeout) waits for a rank behind


def load(folder: Path) -> dict[int, dict]:
    paths = sorted((folder / "collectives").glob("rank-*.json"))
    if not paths:
        raise ConfigError(f"why-hung: {folder} has no collectives/rank-*.json: dumps are written on a collective "
                          "timeout, or on SIGUSR1/SIGUSR2 to the ranks, into the job's checkpoint.folder (else the "
                          "folder of its metrics.jsonl, else the folder it ran in)")
    dumps = {}
    for path in paths:
        try:
            row = json.loads(path.read_text())
            dumps[int(row["rank"])] = row
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"why-hung: {path} is not a dump of plait's ({e})") from None
    return dumps


def caller(entry: dict) -> str:
    """The innermost frame of plait's own code that called the collective (else the innermost)."""
    frames = entry.get("frames") or []
    own = [f for f in frames if "/plait/" in f.get("filename", "")]
    frame = (own or frames or [None])[0]
    if frame is None:
        return "?"
    return f"{frame['filename'].rsplit('/plait/', 1)[-1] if own else frame['filename']}:{frame['line']} {frame['name']}"


def describe(entry: dict) -> str:
    sizes = ", ".join("x".join(map(str, s)) or "scalar" for s in entry.get("input_sizes") or [])
    dtypes = ",".join(entry.get("input_dtypes") or [])
    return f"#{entry['collective_seq_id']} {entry['profiling_name']} ({sizes} {dtypes}) from {caller(entry)}"


def groups(dumps: dict[int, dict]) -> dict[str, dict[int, dict[int, dict]]]:
    """{group: {rank: {sequence number: entry}}} of the collectives (not point-to-point ones)."""
    found: dict[str, dict[int, dict[int, dict]]] = {}
    for rank, row in dumps.items():
        for entry in row["trace"].get("entries", []):
            if not entry.get("is_p2p"):
                name = "/".join(map(str, entry["process_group"]))
                found.setdefault(name, {}).setdefault(rank, {})[entry["collective_seq_id"]] = entry
    return found


def key(entry: dict) -> tuple:
    """What every rank's call of one collective has alike: the op and the line that called it, and
    the sizes where they must agree (not a gather's root and leaves, nor all-to-all's splits)."""
    name = entry["profiling_name"]
    alike = any(op in name for op in SAME_SIZES)
    return name, json.dumps(entry.get("input_sizes")) if alike else None, caller(entry)


def verdicts(dumps: dict[int, dict]) -> list[str]:
    lines = []
    world = max(row.get("world_size", 1) for row in dumps.values())
    missing = sorted(set(range(world)) - set(dumps))
    if missing:
        lines.append(f"ranks {missing} wrote no dump (dead, or they never reached a collective timeout or the signal)")
    for group, ranks in sorted(groups(dumps).items()):
        common = sorted(set.intersection(*(set(seqs) for seqs in ranks.values())))
        apart = next((n for n in common if len({key(ranks[r][n]) for r in ranks}) > 1), None)
        if apart is not None:
            calls = "; ".join(f"rank {r}: {describe(ranks[r][apart])}" for r in sorted(ranks))
            lines.append(f"group {group}: the ranks went apart at collective #{apart}: {calls}")
            continue
        last = {r: max(seqs) for r, seqs in ranks.items()}
        low = min(last.values())
        behind = sorted(r for r, n in last.items() if n == low)
        # how long each rank ahead had been in its last collective when it dumped
        waited = {r: (dumps[r]["time_ns"] - ranks[r][n]["time_created_ns"]) / 1e9 for r, n in last.items() if n > low}
        patience = min(WAITED_S, min(ranks[r][n]["timeout_ms"] for r, n in last.items()) / 2000)
        if not waited or max(waited.values()) < patience:  # (a snapshot of a run in flight: ranks a step apart)
            lines.append(f"group {group}: no rank is behind (ranks {sorted(last)}, last collectives "
                         f"#{low}-#{max(last.values())}, none waited {patience:.0f} s)")
            continue
        ahead = max(waited, key=waited.get)
        lines.append(f"group {group}: rank{'s' * (len(behind) > 1)} {', '.join(map(str, behind))} "
                     f"({', '.join(dumps[r]['host'] for r in behind)}) behind: last collective "
                     f"{describe(ranks[behind[0]][low])}; ranks {sorted(waited)} wait in "
                     f"{describe(ranks[ahead].get(low + 1, ranks[ahead][last[ahead]]))} "
                     f"({max(waited.values()):.0f} s at their dumps)")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: plait why-hung FOLDER  (the job's checkpoint.folder, else its metrics.jsonl's folder)")
        return 0 if argv in (["-h"], ["--help"]) else 2
    dumps = load(Path(argv[0]))
    print(f"plait: why-hung: {len(dumps)} dumps ({', '.join(sorted({d['why'] for d in dumps.values()}))})")
    for line in verdicts(dumps):
        print(f"plait: why-hung: {line}")
    return 0
