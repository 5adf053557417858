"""What the result-table scripts (plan_vs_measured.py, longest_table.py) share: the H200's free
HBM they plan with, and their command line (a results CSV in, a markdown table out)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
# Free HBM of the H200 at the start of a run (139.8 GiB total, the CUDA context takes the rest).
H200_FREE_HBM_GIB = 139.3


def table_main(doc: str, render: Callable[[Path], str], argv: list[str] | None = None) -> int:
    """Parse ``[csv] [--markdown OUT]``, print ``render(csv)`` and write it to OUT if given."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("csv", nargs="?", type=Path, default=BENCH_DIR / "results" / "results.csv")
    p.add_argument("--markdown", type=Path, help="also write the table here")
    a = p.parse_args(argv)
    text = render(a.csv)
    print(text, end="")
    if a.markdown:
        a.markdown.write_text(text)
    return 0
