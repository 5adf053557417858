"""Merge what a GPU-machine phase packed (``results-<phase>.tgz``) into benchmarks/results/.

    python3 benchmarks/merge_results.py /work/.device/N/results-*.tgz [...]

Each archive holds a ``benchmarks/results`` tree. Rows of its ``results.csv`` not yet in ours
(keyed by date, tag, system, model, sequence length, tokens per step and micro-batch: one sweep
may run a system at two micro-batches; a tag re-run later is a new row) are appended; sweep summaries
(``<date>-<tag>.md``) and sweep logs (``logs/<date>-<tag>.log``) that ours lacks are copied beside
the CSV (logs of phases, ``*-phase-*.log``, stay in the git-ignored logs folder); traces go to
``traces/``. Prints what it added.
"""

from __future__ import annotations

import argparse
import csv
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR.parent) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR.parent))

from benchmarks.bench import append_csv  # noqa: E402

RESULTS = BENCH_DIR / "results"


def _key(row: dict) -> tuple[str, ...]:
    return tuple(
        row.get(k, "")
        # The date (to the second) too: a tag re-run at a later start is a new measurement.
        for k in ("date", "tag", "system", "model", "seq_len", "tokens_per_step", "micro_batch")
    )


def merge_tree(src: Path, dst: Path) -> list[str]:
    """Merge one extracted ``benchmarks/results`` tree ``src`` into ``dst``; what was added."""
    added: list[str] = []
    ours = dst / "results.csv"
    have = set()
    if ours.is_file():
        with ours.open(newline="") as f:
            have = {_key(r) for r in csv.DictReader(f)}
    theirs = src / "results.csv"
    if theirs.is_file():
        with theirs.open(newline="") as f:
            new = [r for r in csv.DictReader(f) if _key(r) not in have]
        if new:
            append_csv(ours, new)
            added += [f"row {r.get('tag')} {r['system']} {r['model']} {r['status']}" for r in new]
    for md in sorted(src.glob("*.md")):
        if not (dst / md.name).exists():
            shutil.copy2(md, dst / md.name)
            added.append(md.name)
    for log in sorted((src / "logs").glob("*.log")) if (src / "logs").is_dir() else []:
        target = dst / "logs" / log.name if "-phase-" in log.name else dst / log.name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(log, target)
            added.append(str(target.relative_to(dst)))
    for trace in sorted((src / "traces").glob("*")) if (src / "traces").is_dir() else []:
        target = dst / "traces" / trace.name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(trace, target)
            added.append(str(target.relative_to(dst)))
    return added


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("archives", nargs="+", type=Path)
    p.add_argument("--into", type=Path, default=RESULTS, help="results folder to merge into")
    a = p.parse_args(argv)
    for archive in a.archives:
        with tempfile.TemporaryDirectory() as tmp, tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
            tree = Path(tmp) / "benchmarks" / "results"
            if not tree.is_dir():
                print(f"{archive}: no benchmarks/results inside", file=sys.stderr)
                return 1
            for line in merge_tree(tree, a.into):
                print(f"{archive.name}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
