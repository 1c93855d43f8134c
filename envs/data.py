"""Dataset rows for the envs: `load_rows(path_or_name) -> [{"question": str, "answer": str, ...}]`.

Column mapping, the first one that holds a value wins (other columns are kept as they are):
- question <- `question`, `problem`, `prompt`; a `prompt` that is a list of chat messages (DAPO-Math-17k)
  gives its last user message's content.
- answer <- `answer`, `solution`, `reward_model["ground_truth"]` (DAPO-Math-17k); an answer ending in
  `#### <number>` (GSM8K) gives that number, its thousands separators removed; a list of one
  answer gives that answer; a number gives its decimal digits (no exponent).
A file that is not UTF-8 JSON lines (one object a line), has no rows, or has a row without a question
or an answer (NaN, pandas' missing value, is none), or whose answer is a longer list or an object,
raises ValueError naming the line or row index and the field, so a bad dataset fails before training
starts (in one line: `load_datasets`).
"""

import codecs
import decimal
import json
import math
import os

from envs.math_env import GSM8K_NUMBER, _clean


def _question(row: dict) -> str | None:
    for key in ("question", "problem", "prompt"):
        q = row.get(key)
        if isinstance(q, list):  # chat messages
            users = [m.get("content") for m in q if isinstance(m, dict) and m.get("role") == "user"]
            q = users[-1] if users else None
        if isinstance(q, str) and q.strip():
            return q
    return None


def _answer(row: dict) -> str | None:
    """The ground truth as a string; None if missing; ValueError for one no string can stand for."""
    ground_truth = (
        row["reward_model"].get("ground_truth") if isinstance(row.get("reward_model"), dict) else None
    )
    # The first column that holds one: a file mixing layouts has every column in every row (parquet,
    # pandas), the absent ones null or NaN, as `_question` already reads its columns.
    a = next((c for c in (row.get("answer"), row.get("solution"), ground_truth) if not _missing(c)), None)
    # Some datasets store the ground truth as a list of one; str() would make it "['5']", which no
    # answer ever matches, so every reward would silently be wrong.
    if isinstance(a, list | tuple) and len(a) == 1:
        a = a[0]
    if isinstance(a, list | tuple | dict):
        raise ValueError(
            f"answer is a {type(a).__name__} ({str(a)[:60]}), but the reward compares one answer: give "
            "a string or a number (or a list of exactly one)"
        )
    if _missing(a):
        return None
    # A float as written out, never in an exponent: str(1e-05) is "1e-05", which math-verify reads as
    # Euler's e minus 5 (so 0.00001 would score wrong and e - 5 right).
    a = format(decimal.Decimal(repr(a)), "f") if isinstance(a, float) and math.isfinite(a) else str(a)
    # GSM8K: reasoning, then "#### 72". Only a number counts (as `math_env.last_answer` reads it): in a
    # worked solution `#### Part (b)` is a markdown heading, and taking the text after it, commas
    # deleted, turned `\\boxed{(1, 2)}` into `(1 2)`. Read by the model's rule (`_clean`): only commas before
    # three digits go, so `#### 3,5` stays 3,5 (every comma went: the gold 35 scored a right 3,5 wrong).
    gsm8k = _clean(a.rsplit("####", 1)[1], True) if "####" in a else ""
    return gsm8k if GSM8K_NUMBER.fullmatch(gsm8k) else a


def _missing(a: object) -> bool:
    """None, a blank string, or NaN (pandas' missing value; json.dumps writes it `NaN`), not "nan"."""
    return a is None or (isinstance(a, str) and not a.strip()) or (isinstance(a, float) and math.isnan(a))


def normalize_rows(raw: list[dict]) -> list[dict]:
    rows = []
    for i, r in enumerate(raw):
        try:
            q, a = _question(r), _answer(r)
        except ValueError as e:
            raise ValueError(f"row {i}: {e}") from None
        if q is None:
            raise ValueError(f"row {i}: no question (looked for 'question', 'problem', 'prompt')")
        if a is None:
            raise ValueError(
                f"row {i}: no answer (looked for 'answer', 'solution', 'reward_model.ground_truth')"
            )
        rows.append({**r, "question": q, "answer": a})
    return rows


def load_rows(path_or_name: str, split: str = "train") -> list[dict]:
    """Rows from a local .jsonl / .parquet file, or a Hugging Face dataset name (its `split`)."""
    if path_or_name.endswith(".jsonl"):
        raw = []
        # Bytes, decoded line by line: a byte that is not UTF-8 is then a ValueError naming its line.
        with open(path_or_name, "rb") as f:
            for n, line in enumerate(f, 1):
                if n == 1:  # a byte-order mark (Notepad, PowerShell 5) opens a file that is still UTF-8
                    line = line.removeprefix(codecs.BOM_UTF8)
                if not line.strip():
                    continue
                try:
                    line = line.decode()
                    row = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"line {n}: not JSON ({e})") from None
                # Valid JSON that is not an object (`["q", "a"]`, `null`) would fail later, far from
                # its line, with an AttributeError instead of this one line.
                if not isinstance(row, dict):
                    raise ValueError(
                        f"line {n}: {line.strip()[:60]} is not a JSON object; write one object per line, "
                        'e.g. {"question": "1+1?", "answer": "2"}'
                    )
                raw.append(row)
    elif path_or_name.endswith(".parquet"):
        import pyarrow.parquet as pq

        with open(path_or_name, "rb") as f:  # a missing file says so (pyarrow's error is its name alone)
            raw = pq.read_table(f).to_pylist()
    elif os.path.exists(path_or_name):
        raise ValueError(f"{path_or_name}: expected a .jsonl or .parquet file")
    else:
        import datasets

        raw = list(datasets.load_dataset(path_or_name, split=split))
    if not raw:
        raise ValueError("no rows")
    return normalize_rows(raw)


def load_datasets(dataset: str, eval_dataset: str | None, eval_limit: int) -> tuple[list[dict], list[dict]]:
    """The training rows (`dataset`, its train split) and the held-out ones (`eval_dataset`'s first
    `eval_limit`, its test split; none without it). A dataset that cannot be read, has no rows or a bad
    row raises ValueError in one line naming its flag."""

    def load(flag: str, path: str, split: str) -> list[dict]:
        try:
            return load_rows(path, split)
        except (ValueError, OSError) as e:  # not JSON lines, no rows, a bad row; a hub dataset not found
            raise ValueError(f"{flag} {path}: {e}") from None

    rows = load("--dataset", dataset, "train")
    return rows, load("--eval-dataset", eval_dataset, "test")[:eval_limit] if eval_dataset else []
