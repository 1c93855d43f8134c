"""docs/benchmarks.md's table of figures is bench/table.py's rendering of bench/results.json: every figure
there is the one the results file holds, with the command that measured it (`make bench` rewrites both)."""

import json
from pathlib import Path

import pytest

from bench.table import HEADER, render, replace_table

REPO = Path(__file__).resolve().parent.parent


def test_docs_table_is_the_results_files_rendering() -> None:
    table = render(json.loads((REPO / "bench/results.json").read_text()))
    docs = (REPO / "docs/benchmarks.md").read_text()
    assert replace_table(docs, table) == docs, (
        "docs/benchmarks.md's table differs from bench/results.json: "
        "python bench/table.py --docs docs/benchmarks.md rewrites it"
    )
    assert len(table) > 20  # every figure has a row: the check above compared something


def test_replace_table_replaces_the_table_alone() -> None:
    text = f"# t\n\nabove\n\n{HEADER}\n|---|---|---|---|\n| old | 1 | x | `c` |\n\nbelow | not a row\n"
    new = [HEADER, "|---|---|---|---|", "| new | 2 | y | `d` |"]
    rows = "\n".join(new)
    assert replace_table(text, new) == f"# t\n\nabove\n\n{rows}\n\nbelow | not a row\n"


def test_replace_table_without_a_table_says_where_it_goes() -> None:
    with pytest.raises(SystemExit, match="no line .* to replace; put it where the table goes"):
        replace_table("# no table\n", [HEADER])


def test_every_figure_in_the_results_file_has_a_row() -> None:
    results = json.loads((REPO / "bench/results.json").read_text())
    table = "\n".join(render(results))
    missing = [k for k, v in results.items() if f"`{v['command']}`" not in table]
    assert not missing, f"bench/table.py renders no row for {missing}"
