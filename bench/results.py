"""The one results file every bench script writes into: one key per figure, merged, never overwritten."""

import json
from pathlib import Path


def merge_results(path: str | Path, figures: dict) -> None:
    """Merge `figures` ({key: {values..., "command", "settings"}}) into the JSON file at `path`."""
    path = Path(path)
    merged = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(merged | figures, indent=2) + "\n")
