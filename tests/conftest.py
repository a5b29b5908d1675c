import os, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

def run(cmd, cwd=ROOT, env=None, timeout=600, check=True):
    "Run a command with the test interpreter's environment; return the CompletedProcess (stdout+stderr as text)."
    e = {**os.environ, **(env or {})}
    e.pop('IN_TEST', None)
    p = subprocess.run(cmd, cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}")
    return p

@pytest.fixture
def root(): return ROOT
