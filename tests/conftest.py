import os, signal, subprocess, sys
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

def two_ranks(test_file:str, worker:str, out, timeout:float=600):
    """Run `worker(out)` from `test_file` on 2 gloo CPU ranks via accelerate's debug_launcher, in a fresh interpreter:
    forking the pytest process after torch ran multithreaded ops deadlocks the children. The launcher gets its own
    process group, so a hang (no result in `timeout` s) takes both ranks down with it and fails the test."""
    code = (f"import sys; sys.path.insert(0, {str(Path(test_file).parent)!r}); import {Path(test_file).stem} as t; "
            f"from accelerate import debug_launcher; debug_launcher(lambda: t.{worker}({str(out)!r}), num_processes=2)")
    p = subprocess.Popen([sys.executable, '-c', code], start_new_session=True)
    try: rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL); p.wait()
        pytest.fail(f"{worker} on 2 ranks hung: no result in {timeout} s")
    assert rc == 0, f"{worker} on 2 ranks exited with {rc} (its output is above)"

def free_port() -> int:
    "A TCP port nobody listens on now (for a launcher's rendezvous; tests run beside other launches)."
    import socket
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def launch(script, *args, num_processes:int=2, probe=None, env=None, timeout=600):
    """Run repository `script` with `args` in `num_processes` processes: 2 or more are real gloo CPU ranks
    (`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu`), 1 is a plain interpreter. With `probe=DIR` the script runs
    under tests/dist_probe.py, which writes what each rank saw, held and wrote to DIR/rank<r>.pt."""
    target = [str(ROOT/'tests'/'dist_probe.py'), str(probe)] if probe else []
    target += [str(ROOT/script if not Path(script).is_absolute() else script), *map(str, args)]
    if num_processes == 1: cmd = [sys.executable, *target]
    else: cmd = [str(BIN/'accelerate'), 'launch', '--multi_gpu', '--num_processes', str(num_processes),
                 '--num_machines', '1', '--mixed_precision', 'no', '--dynamo_backend', 'no',
                 '--main_process_port', str(free_port()), *target]
    return run(cmd, env={'ACCELERATE_USE_CPU': '1', **(env or {})}, timeout=timeout)

def rank_records(probe, n:int) -> list[dict]:
    "The records tests/dist_probe.py wrote for ranks 0..n-1 of one launch."
    import torch
    return [torch.load(Path(probe)/f'rank{r}.pt', weights_only=False) for r in range(n)]
