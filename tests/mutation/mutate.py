"""`make mutate`: mutation testing of TRIO's core, and a score per module.

mutmut (pinned in the Makefile; configured under ``[tool.mutmut]`` in pyproject.toml)
changes one thing at a time in the modules below (an operator, a constant, a key, a
call's argument) and runs the fast tests that cover the changed function. A mutant the
tests notice is *killed*; one they don't is a *survivor*, i.e. a behaviour no test holds.

Some survivors are *equivalent*: the change cannot alter behaviour (say ``<`` for
``<=`` where the two sides are never equal). They are listed in ``equivalent.txt``
beside this file, one per line with the reason, and left out of the score:

    score = killed / (mutants - equivalent)        target: >= 90 % per module

(``unchecked`` counts mutants a run has not reached yet; they are not in the score.)

Log calls are not mutated (``do_not_mutate_patterns``): their text is for operators.

Mutant names carry a number per function, so an edit to a function renumbers its
mutants: rerun, then check the survivors this script prints and update the list.

A run checks only the mutants without a result (mutmut keeps them in ``mutants/``; an edit
to a function clears its mutants' results) and the survivors not listed as equivalent, so
an interrupted run goes on where it stopped; ``--rerun`` checks everything again.

Usage: python tests/mutation/mutate.py [--report-only] [--rerun] [--jobs N]
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUTMUT = str(Path(sys.executable).with_name("mutmut"))
EQUIVALENT = Path(__file__).with_name("equivalent.txt")
TARGET = 0.90

# The core's request path: submit -> queue -> ordered execution -> resolve -> retrieve.
CORE_PATH = [f"trio_server.core.xǁServiceCoreǁ{name}__mutmut_*" for name in (
    "submit", "retrieve", "_stored_outcome", "_queue_info", "_unregister", "_idempotent",
    "_check_seq", "resolve", "_forget_old", "_recover",
)]
MODULES: dict[str, list[str]] = {
    "trio_engine.losses": ["trio_engine.losses.*"],
    "trio_engine.optim": ["trio_engine.optim.*"],
    "trio_engine.lora": ["trio_engine.lora.*"],
    "trio_engine.attention": ["trio_engine.attention.*"],
    "trio_engine.norm": ["trio_engine.norm.*"],
    "trio_engine.sampler": ["trio_engine.sampler.*"],
    "trio_engine.kv_cache": ["trio_engine.kv_cache.*"],
    "trio_server.scheduler": ["trio_server.scheduler.*"],
    "trio_server.core (submit/retrieve/ordering)": CORE_PATH,
    "trio_server.worker (ordering, batching)": ["trio_server.worker.*"],
}
KILLED = {"killed", "timeout", "caught by type check"}


def in_scope(name: str) -> bool:
    return any(fnmatch.fnmatch(name, p) for group in MODULES.values() for p in group)


def run_mutmut(jobs: int, rerun: bool) -> None:
    """Run the in-scope mutants that have no result yet, and the survivors not listed as
    equivalent or without a covering test (a test added since may kill them, or a fresh
    trace of the tests map them); all of them with ``rerun``.

    mutmut reruns every mutant it is *named* (a pattern counts), so the patterns go to it
    only for a first or full run; otherwise it gets exact names. Its run starts by
    regenerating the mutants of edited functions, which clears their results (``refresh``
    does only that), so this loops until nothing in scope is left unchecked.
    """
    patterns = [p for group in MODULES.values() for p in group]
    survivors: list[str] = []
    if (ROOT / "mutants").is_dir() and not rerun:
        refresh()
        equivalent = equivalent_mutants()
        survivors = [n for n, s in results().items()
                     if in_scope(n) and s in ("survived", "no tests") and n not in equivalent]
    for _ in range(3):  # a run may reset edited functions: check those again
        status = results() if (ROOT / "mutants").is_dir() else {}
        todo = sorted(n for n, s in status.items() if in_scope(n) and s == "not checked") + survivors
        if rerun or not any(map(in_scope, status)):
            names, rerun = patterns, False
        elif todo:
            names, survivors = todo, []
        else:
            return
        print(f"$ mutmut run --max-children {jobs} <{len(names)} {'patterns' if names is patterns else 'mutants'}>",
              flush=True)
        subprocess.run([MUTMUT, "run", "--max-children", str(jobs), *names], cwd=ROOT, check=False)


def refresh() -> None:
    """Regenerate the mutants of functions edited since the last run, which clears their
    results (so they count as unchecked). mutmut does this at the start of every run; a
    name that matches no mutant makes it stop right after (with "nothing matches")."""
    print("$ mutmut run <no mutant>  # regenerate the mutants of edited functions", flush=True)
    subprocess.run([MUTMUT, "run", "refresh.only.*"], cwd=ROOT, check=False, capture_output=True)


def results() -> dict[str, str]:
    """Every mutant's status, from ``mutmut results --all true``."""
    out = subprocess.run([MUTMUT, "results", "--all", "true"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    pairs = (line.strip().rsplit(": ", 1) for line in out.splitlines() if ": " in line)
    return {name: status for name, status in pairs}


def equivalent_mutants() -> dict[str, str]:
    """name -> why, from equivalent.txt (``name  reason``; # starts a comment)."""
    listed = {}
    for line in EQUIVALENT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, why = line.partition(" ")
            listed[name] = why.strip()
    return listed


def verdict(name: str, status: dict[str, str], equivalent: dict[str, str]) -> str:
    if status[name] in KILLED:
        return "killed"
    if status[name] == "not checked":
        return "unchecked"
    return "equivalent" if name in equivalent else "survived"


def report(status: dict[str, str], equivalent: dict[str, str]) -> bool:
    """The table; True when every module is fully checked and at the target."""
    ok = True
    print(f"\n{'module':46} {'mutants':>7} {'killed':>7} {'equiv':>6} {'survived':>8} {'unchecked':>9} {'score':>7}")
    for module, patterns in MODULES.items():
        names = [n for n in status if any(fnmatch.fnmatch(n, p) for p in patterns)]
        counts = Counter(verdict(n, status, equivalent) for n in names)
        scored = counts["killed"] + counts["survived"]  # of the checked, non-equivalent mutants
        score = counts["killed"] / scored if scored else None  # None: none to score (yet)
        ok &= not counts["unchecked"] and (score is None or score >= TARGET)
        print(f"{module:46} {len(names):7} {counts['killed']:7} {counts['equivalent']:6} "
              f"{counts['survived']:8} {counts['unchecked']:9} {'-' if score is None else f'{score:.1%}':>7}")
    survivors = sorted(n for n in status if in_scope(n) and verdict(n, status, equivalent) == "survived")
    if survivors:
        print("\nSurvivors not listed as equivalent (see `mutmut show NAME`):")
        for name in survivors:
            print(f"  {name}: {status[name]}")
    stale = [n for n in equivalent if status.get(n) in KILLED or n not in status]
    if stale:
        print("\nListed as equivalent but killed or gone (renumbered? update equivalent.txt):")
        print("\n".join(f"  {n}" for n in stale))
    print(f"\n{'PASS' if ok else 'FAIL'}: target {TARGET:.0%} of checked, non-equivalent mutants killed "
          "in each module, all checked")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-only", action="store_true", help="print the last run's scores")
    # twice the cores: mutants that stall a queue sleep until their timeout
    parser.add_argument("--jobs", type=int, default=2 * (os.cpu_count() or 1))
    parser.add_argument("--rerun", action="store_true", help="rerun mutants that already have a result")
    args = parser.parse_args()
    if not args.report_only:
        run_mutmut(args.jobs, args.rerun)
    return 0 if report(results(), equivalent_mutants()) else 1


if __name__ == "__main__":
    sys.exit(main())
