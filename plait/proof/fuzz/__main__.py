"""python -m plait.proof.fuzz {hf,restart,options,startup,files} --examples N [--seed S]: one generator
for as long as asked; prints how the cases ended, or the shrunk counter-example (which says how
to reproduce it) and exits 1."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from plait.proof.fuzz import Counterexample, run

# generator -> (module, its attribute): `startup` is the options generator's start-up half over
# values past every limit, without training (cheap: no rank starts).
MODULES = {"hf": ("hf_configs", "GENERATOR"), "restart": ("restart", "GENERATOR"), "options": ("options", "GENERATOR"),
           "startup": ("options", "STARTUP"), "files": ("files", "GENERATOR")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plait.proof.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("generator", choices=sorted(MODULES))
    parser.add_argument("--examples", type=int, default=100, help="generated cases to run (the pinned ones run too)")
    parser.add_argument("--seed", type=int, default=0, help="the generation's seed: the same seed, the same cases")
    opts = parser.parse_args(argv)
    module, attribute = MODULES[opts.generator]
    generator = getattr(importlib.import_module(f"plait.proof.fuzz.{module}"), attribute)
    start = time.perf_counter()
    try:
        outcomes = run(generator, opts.examples, opts.seed)
    except Counterexample as e:
        print(f"fuzz {opts.generator}: counter-example (shrunk): {e}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    print(f"fuzz {opts.generator}: {sum(outcomes.values())} cases in {seconds:.0f} s, seed {opts.seed}")
    for outcome, count in outcomes.most_common():
        print(f"  {count:6d}  {outcome}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
