"""Per-module mutation score from `mutmut results --all true` (run from the repository root).

Score = detected / checked, where detected = killed + timeout (a mutant that hangs the tests is caught)
and checked = every mutant mutmut has run (killed, timeout, survived, no tests, suspicious, segfault).
Mutants not checked yet (a run limited by MUTANTS, or interrupted) are counted apart, never in the score.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter, defaultdict

DETECTED = ("killed", "timeout")


def module_of(mutant: str) -> str:
    """`engine.block_manager.xǁBlockManagerǁfree__mutmut_3` -> `engine.block_manager`."""
    return mutant.split(".x")[0] if ".x" in mutant else mutant.rsplit(".", 1)[0]


def main() -> int:
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], capture_output=True,
                         text=True, check=True).stdout
    by_module: dict[str, Counter[str]] = defaultdict(Counter)
    for line in out.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep:
            by_module[module_of(name)][status] += 1
    total: Counter[str] = Counter()
    for module in sorted(by_module):
        _report(module, by_module[module])
        total.update(by_module[module])
    _report("all modules", total)
    return 0


def _report(label: str, counts: Counter[str]) -> None:
    unchecked = counts["not checked"]
    checked = sum(counts.values()) - unchecked
    detected = sum(counts[s] for s in DETECTED)
    score = f"{100 * detected / checked:5.1f}%" if checked else "    -"
    others = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()) if s not in (*DETECTED, "not checked"))
    print(f"{label:24} {score}  {detected}/{checked} detected ({counts['killed']} killed, {counts['timeout']} timeout"
          f"{', ' + others if others else ''}){f', {unchecked} not checked' if unchecked else ''}")


if __name__ == "__main__":
    sys.exit(main())
