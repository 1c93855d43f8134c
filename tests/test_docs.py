"""The docs against the code they describe: every test README.md and docs/*.md name as a guarantee's
proof exists, and docs/flags.md lists every flag of the trainer with the default argparse gives it."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# `tests/test_x.py::test_y`, `test_x.py::test_y[param]`, and `::test_z` (of the file named last before it);
# `::test_y_*` names every test of that prefix, and must name one
REFERENCE = re.compile(r"(?:(test_\w+)\.py)?::(test_\w+)(\*?)")


def _tests_in(file: Path) -> set[str]:
    tree = ast.parse(file.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_test_the_docs_name_exists():
    """A renamed or deleted test leaves its guarantee without proof while the docs still cite it."""
    defined = {f.stem: _tests_in(f) for f in (REPO / "tests").glob("test_*.py")}
    missing, cited = [], 0
    for doc in DOCS:
        last_file = None
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in REFERENCE.finditer(line):
                last_file = m[1] or last_file
                cited += 1
                names = defined.get(last_file, set())
                if not (m[2] in names or m[3] and any(name.startswith(m[2]) for name in names)):
                    missing.append(f"{doc.relative_to(REPO)}:{n}: {last_file}.py::{m[2]}")
    assert cited > 100  # the pattern still reads the docs
    assert not missing, "tests named in the docs that do not exist:\n" + "\n".join(missing)


def test_flags_md_lists_every_flag_with_its_default():
    """docs/flags.md: one row per flag of train_async_grpo.py, none that is not one, and where the
    row's default is a plain number or a `word`, argparse's."""
    from train_async_grpo import parser

    options = {
        max(a.option_strings, key=len): a for a in parser._actions if a.option_strings and a.dest != "help"
    }
    rows = {}
    for line in (REPO / "docs" / "flags.md").read_text().splitlines():
        m = re.match(r"\| `(--[\w-]+)` \| ([^|]*) \|", line)
        if m:
            rows[m[1]] = m[2].strip()
    assert sorted(set(options) - set(rows)) == [], "flags missing from docs/flags.md"
    assert sorted(set(rows) - set(options)) == [], "rows of docs/flags.md that are no flag"
    wrong, compared = [], []
    for flag, written in rows.items():
        default = options[flag].default
        plain = re.fullmatch(r"`([^`]*)`|(-?[\d.e+-]+)(?: \(.*\))?", written)
        if not plain or isinstance(default, bool) or default is None:
            continue
        compared.append(flag)
        value = plain[1] if plain[1] is not None else plain[2]
        same = str(default) == value if plain[1] is not None else float(value) == float(default)
        if not same:
            wrong.append(f"{flag}: docs/flags.md says {written}, argparse {default!r}")
    assert len(compared) > 25  # the pattern still reads the table
    assert not wrong, "\n".join(wrong)
