"""scripts/gpu_check.py (`make gpu-check`, written for a GPU box without vLLM) runs its checks on the CPU
too: every check passes and vLLM is never imported."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_gpu_check_runs_on_the_cpu():
    script = REPO / "scripts" / "gpu_check.py"
    cmd = [sys.executable, str(script), "--device", "cpu", "--small", "--steps", "1"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith(("PASS", "FAIL"))]
    assert len(lines) == 6 and all(x.startswith("PASS") for x in lines), r.stdout
    assert "6/6 checks passed; vLLM not imported" in r.stdout
