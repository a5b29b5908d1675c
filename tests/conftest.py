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

def two_ranks(test_file:str, worker:str, out):
    """Run `worker(out)` from `test_file` on 2 gloo CPU ranks via accelerate's debug_launcher, in a fresh interpreter:
    forking the pytest process after torch ran multithreaded ops deadlocks the children."""
    code = (f"import sys; sys.path.insert(0, {str(Path(test_file).parent)!r}); import {Path(test_file).stem} as t; "
            f"from accelerate import debug_launcher; debug_launcher(lambda: t.{worker}({str(out)!r}), num_processes=2)")
    subprocess.run([sys.executable, '-c', code], check=True, timeout=600)
