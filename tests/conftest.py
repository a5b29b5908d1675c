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

def pytest_addoption(parser):
    parser.addoption('--slow', action='store_true', default=False,
                     help="also run the tests marked slow (second variants of heavy end-to-end checks; `make test SLOW=1`)")

def pytest_collection_modifyitems(config, items):
    if config.getoption('--slow'): return
    skip = pytest.mark.skip(reason="marked slow: run with `make test SLOW=1` or `pytest --slow`")
    for item in items:
        if 'slow' in item.keywords: item.add_marker(skip)

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

_MANY = r'''
import contextlib, io, json, os, runpy, signal, sys, traceback
calls, limit, res = json.loads(sys.argv[1]), int(sys.argv[2]), []
class RanTooLong(BaseException): pass
def stop(*_): raise RanTooLong()
signal.signal(signal.SIGALRM, stop)
for script, argv, env in calls:
    out, err, rc = io.StringIO(), io.StringIO(), 0
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    sys.argv = [script, *argv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            signal.alarm(limit)
            try: runpy.run_path(script, run_name='__main__')
            finally: signal.alarm(0)
        except SystemExit as e: rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except RanTooLong: rc = 124; err.write(f'RUN_MANY: still running after {limit} s, stopped (the call started real work)\n')
        except BaseException: rc = 1; err.write(traceback.format_exc())
    for k, v in old_env.items():
        if v is None: os.environ.pop(k, None)
        else: os.environ[k] = v
    res.append({'returncode': rc, 'stdout': out.getvalue(), 'stderr': err.getvalue()})
print('RUN_MANY ' + json.dumps(res), flush=True)
'''

def run_many(calls, timeout=600, case_timeout:int|None=None) -> list[dict]:
    """Run each `(script, argv[, env])` of `calls` as `python script *argv` would, one after the other in ONE fresh
    interpreter (runpy, `__name__ == '__main__'`), and return `{'returncode', 'stdout', 'stderr'}` for each.
    For the CLI checks that end before any work starts (--help, refused flags and configs): they would each pay the
    seconds torch + diffusers take to import; a fresh process per check is kept for everything that trains or launches.
    With `case_timeout` each call is stopped after that many seconds (SIGALRM) and reported with return code 124 and
    a line saying so: a check that was meant to be refused but starts real work fails on its own, not the whole table."""
    import json
    calls = [(str(ROOT/c[0]), list(map(str, c[1])), dict(c[2]) if len(c) > 2 else {}) for c in calls]
    p = run([sys.executable, '-c', _MANY, json.dumps(calls), str(case_timeout or 0)], timeout=timeout)
    return json.loads(next(l for l in p.stdout.splitlines() if l.startswith('RUN_MANY '))[len('RUN_MANY '):])   # whatever else was printed (exit hooks, warnings) is ignored

def assert_same_image(a, b, levels:int=1, share:float=0.01):
    """PNG files `a` and `b` hold the same image: at most `share` of the pixels differ, by at most `levels` grey levels. The
    same seed drawn in another batch (1 rank or 2, batch size 1 or 2) runs CPU kernels that round differently, so a
    pixel that sits on a rounding boundary may land one level off; another seed or another prompt differs everywhere."""
    import numpy as np
    from PIL import Image
    x, y = (np.asarray(Image.open(f).convert('RGB')).astype(int) for f in (a, b))
    assert x.shape == y.shape, (a, x.shape, y.shape)
    d = np.abs(x - y)
    assert d.max() <= levels and (d.sum(-1) > 0).mean() <= share, f"{a} and {b}: up to {d.max()} levels apart on {(d.sum(-1) > 0).mean():.2%} of the pixels"
