"""The job scripts in slurm/ on a real Slurm cluster started on this host (Debian's slurmctld/slurmd/munge, two fake
nodes with two fake GPUs each): JupyterLab, TensorBoard and the MLflow UI behind the printed tunnel (the servers without
a login listen on the node's loopback only), job logs made private (also under paths with spaces) and a Jupyter token
that never reaches a log that cannot be made private, single- and two-node training with accelerate (gloo CPU
processes), preemption -> checkpoint -> requeue -> resume, and no process left behind by scancel. Needs root (the
daemons, the fake GPU devices) and apt when Slurm is not installed."""
import json, os, re, socket, subprocess, sys, time, urllib.error, urllib.request
from pathlib import Path
import psutil, pytest
from conftest import ROOT, BIN, run
from slurm_cluster import SlurmCluster, install_slurm, job_processes

SLURM = ROOT/'slurm'

@pytest.fixture(scope='session')
def cluster(tmp_path_factory):
    if os.geteuid() != 0: pytest.skip("the Slurm tests start slurmctld/slurmd and make fake GPU devices: run them as root")
    if why := install_slurm(): pytest.skip(why)
    c = SlurmCluster(tmp_path_factory.mktemp('slurm'), n_nodes=2, cpus=2, gpus=2)
    try:
        c.start()
        yield c
    finally: c.stop()

@pytest.fixture(scope='session')
def shapes(tmp_path_factory):
    out = tmp_path_factory.mktemp('shapes')
    run([sys.executable, 'scripts/make_shapes.py', '--out', str(out), '--format', 'imagefolder',
         '--n_train', '64', '--n_validation', '4', '--n_test', '4'])
    return out/'imagefolder'/'train'

@pytest.fixture(autouse=True)
def no_job_left(cluster):
    "Whatever a test leaves queued or running (a failed test cannot scancel its job) is cancelled before the next one."
    yield
    leftover = cluster.cmd('squeue', '--noheader', '--format=%i').stdout.split()
    if leftover:
        cluster.cmd('scancel', *leftover, check=False)
        for job in map(int, leftover): cluster.wait(job, timeout=60)

def job_env(**kw) -> dict:
    "What the jobs see on top of the submitting environment: this interpreter's environment, CPU processes."
    return {'ACTIVATE': f'export PATH={BIN}:$PATH', 'ACCELERATE_USE_CPU': '1', **kw}

def wait_for(pred, timeout:float, what:str, every:float=0.3):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if r := pred(): return r
        time.sleep(every)
    raise TimeoutError(f"{what} after {timeout} s")

def read(p:Path) -> str: return p.read_text(errors='replace').replace('\r', '\n') if p.exists() else ''

def http(url:str, headers:dict|None=None, method:str='GET', data:bytes|None=None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers or {}, method=method), timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e: return e.code, e.read().decode(errors='replace')

def port_open(port:int, host:str='127.0.0.1') -> bool:
    with socket.socket(socket.AF_INET6 if ':' in host else socket.AF_INET) as s:
        s.settimeout(5); return s.connect_ex((host, port)) == 0

def serving(log:Path, port:int, timeout:float=30):
    """Wait until Jupyter's "is running at" line is in the log and its port answers: jupyter_server prints that line
    and binds the port a moment later, from its event loop."""
    wait_for(lambda: 'is running at' in read(log) and port_open(port), timeout, f"nothing answers on port {port}:\n{read(log)[-3000:]}")

def tunnel(log:Path, user:str, login:str, via:str='login') -> tuple[int, str]:
    """Port and node of the printed tunnel line: `via='login'` is `ssh -N -L localhost:PORT:NODE:PORT USER@LOGIN` (the
    login host connects to the node's port), `via='node'` is `ssh -N -L localhost:PORT:127.0.0.1:PORT -J USER@LOGIN
    USER@NODE` (an ssh session into the node through the login host, connecting to the node's loopback)."""
    if via == 'login': m = re.search(rf'\n    ssh -N -L localhost:(\d+):(?P<node>\S+):(\d+) {user}@{login}\n', read(log))
    else: m = re.search(rf'\n    ssh -N -L localhost:(\d+):127\.0\.0\.1:(\d+) -J {user}@{login} {user}@(?P<node>\S+)\n', read(log))
    assert m and m[1] == m[3 if via == 'login' else 2], read(log)[-3000:]
    return int(m[1]), m['node']

def listening_on(port:int) -> set[str]:
    "The addresses on which some process of this host listens on TCP `port` (0.0.0.0 / :: mean every interface)."
    return {c.laddr.ip for c in psutil.net_connections('inet') if c.status == psutil.CONN_LISTEN and c.laddr.port == port}

def outside_addresses() -> list[str]:
    "This host's addresses that other machines could connect to (neither loopback nor link-local)."
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)
            and not a.address.startswith(('127.', '::1', 'fe80'))]

def assert_loopback_only(port:int):
    "What `TUNNEL_VIA=node` promises: the server answers on the node's 127.0.0.1 and on none of its other addresses."
    assert listening_on(port) == {'127.0.0.1'}, listening_on(port)
    assert port_open(port)
    for address in outside_addresses(): assert not port_open(port, address), f"port {port} answers on {address}"

def train(cluster, out:Path, shapes:Path, log:Path, *sbatch_args, steps:int=4, env:dict|None=None) -> int:
    args = ['--output_dir', out, '--dataset', shapes, '--max_steps', steps, '--batch_size', 4, '--tracker', 'none',
            '--checkpoint_every', 1000, '--warmup_steps', 0]
    return cluster.sbatch(*sbatch_args, f'--output={log}', SLURM/'train.sbatch', *args, env=job_env(**(env or {})), cwd=ROOT)

def trainer_state(out:Path, step:int) -> dict:
    return json.loads((out/'checkpoints'/f'step_{step:08d}'/'trainer_state.json').read_text())

def test_jupyter_tunnel_token_and_scancel(cluster, tmp_path):
    logs = tmp_path/'jupyter logs'; logs.mkdir()    # a space in the log's path: the job still finds and chmods its log
    job = cluster.sbatch('--cpus-per-task=1', f'--output={logs}/jupyter %j.out', SLURM/'jupyter.sbatch', cwd=ROOT,
                         env=job_env(LOGIN_HOST='login.example.org', TUNNEL_USER='alice', NOTEBOOK_DIR=str(tmp_path)))
    log = logs/f'jupyter {job}.out'
    j = cluster.wait(job, ('RUNNING', 'FAILED', 'CANCELLED', 'COMPLETED'), timeout=60)
    assert j['JobState'] == 'RUNNING' and j['TresPerNode'] == 'gres:gpu:1', (j, read(log))   # the script's --gres line
    wait_for(lambda: 'Jupyter Server' in read(log) and 'is running at' in read(log), 90, f"JupyterLab not serving:\n{read(log)[-3000:]}")
    assert log.stat().st_mode & 0o777 == 0o600, oct(log.stat().st_mode)
    assert read(log).startswith('=' * 80 + f'\nimagegen-jupyter (job {job}) on node'), read(log)[:1000]   # the whole log
    port, node = tunnel(log, 'alice', 'login.example.org')
    assert node == socket.gethostname()
    serving(log, port)
    assert listening_on(port) == {'0.0.0.0'}   # the token guards it: all interfaces, so the login host can tunnel to it
    token = re.search(rf'http://localhost:{port}/lab\?token=(\S+)', read(log))[1]
    assert len(token) >= 32
    base = f'http://127.0.0.1:{port}'   # what the tunnel's far end connects to on the node
    assert http(f'{base}/api/status')[0] == 403
    assert http(f'{base}/api/status', {'Authorization': 'token wrong'})[0] == 403
    status, body = http(f'{base}/api/status', {'Authorization': f'token {token}'})
    assert status == 200 and 'started' in json.loads(body)
    assert http(f'{base}/api/contents?token={token}')[0] == 200
    status, body = http(f'{base}/api/kernels', {'Authorization': f'token {token}'}, 'POST', b'{"name": "python3"}')
    assert status == 201, body
    wait_for(lambda: any('ipykernel' in p for p in job_processes(job)), 30, "no kernel process")
    assert not any(token in p for p in job_processes(job)), "the token is visible in a process's command line"
    cluster.cmd('scancel', str(job))
    assert cluster.wait(job, timeout=60)['JobState'] == 'CANCELLED'
    wait_for(lambda: not job_processes(job), 30, f"job {job} left processes behind: {job_processes(job)}")
    assert not port_open(port)
    assert 'received signal 15, stopping' in read(log) and 'Kernel shutdown' in read(log), read(log)[-2000:]

def test_jupyter_token_never_in_a_log_it_cannot_make_private(cluster, tmp_path):
    """A log the job cannot make private, on a node where scontrol fails: the token must not appear in it. An
    append-only log (not even root may chmod it) stands in for a log of someone else's or on a file system without
    Unix modes. The token goes to a mode-600 file in $HOME, the log names it and says what to do, and JupyterLab runs
    with that token. TUNNEL_VIA=node: Jupyter listens on the node's loopback only, behind an ssh -J tunnel."""
    log, home, fake_bin = tmp_path/'shared log.out', tmp_path/'home', tmp_path/'bin'
    home.mkdir(); fake_bin.mkdir()
    (fake_bin/'scontrol').write_text('#!/bin/sh\necho "scontrol: command not found" >&2\nexit 127\n')
    (fake_bin/'scontrol').chmod(0o755)
    log.touch(); log.chmod(0o644)                  # readable by everyone, and the job cannot change that
    if (p := subprocess.run(['chattr', '+a', str(log)], capture_output=True, text=True)).returncode:
        pytest.skip(f"cannot make a file append-only here (chattr +a: {p.stderr.strip()})")
    try:
        job = cluster.sbatch('--cpus-per-task=1', '--open-mode=append', f'--output={log}', SLURM/'jupyter.sbatch', cwd=ROOT,
                             env=job_env(HOME=str(home), PATH=f"{fake_bin}:{os.environ['PATH']}", TUNNEL_VIA='node',
                                         LOGIN_HOST='login.example.org', TUNNEL_USER='alice', NOTEBOOK_DIR=str(tmp_path)))
        wait_for(lambda: 'is running at' in read(log) or cluster.job(job)['JobState'] not in ('PENDING', 'RUNNING'), 90,
                 f"JupyterLab not serving:\n{read(log)[-3000:]}")
        text = read(log)
        assert not re.search(r'token=[\w-]{20}', text), text[-3000:]
        token_file = home/f'.imagegen-jupyter-{job}.token'
        token = token_file.read_text().strip()
        assert len(token) >= 32 and token_file.stat().st_mode & 0o777 == 0o600 and token not in text
        assert log.stat().st_mode & 0o777 == 0o644                          # still readable by everyone
        port, node = tunnel(log, 'alice', 'login.example.org', via='node')
        assert f'http://localhost:{port}/lab?token=<the token in {token_file}>' in text, text[-3000:]
        assert (f"This job's log ({log}) could not be made readable by you alone, so the token is not printed here" in text
                and f'run `cat {token_file}` on the login host' in text), text[-3000:]
        serving(log, port)
        base = f'http://127.0.0.1:{port}'
        assert http(f'{base}/api/status')[0] == 403
        assert http(f'{base}/api/status', {'Authorization': f'token {token}'})[0] == 200   # the server's token
        assert_loopback_only(port)
        cluster.cmd('scancel', str(job))
        cluster.wait(job, timeout=60)
        wait_for(lambda: not job_processes(job), 30, f"job {job} left processes behind: {job_processes(job)}")
        assert token not in read(log) and 'received signal 15, stopping' in read(log)   # nor in Jupyter's own lines
    finally: subprocess.run(['chattr', '-a', str(log)])

def test_jupyter_busy_port_fails_instead_of_moving(cluster, tmp_path):
    "With --port-retries=0 a taken port stops the job; Jupyter must not move to a port the printed tunnel does not name."
    with socket.socket() as s:
        s.bind(('', 0)); s.listen(); port = s.getsockname()[1]
        job = cluster.sbatch('--cpus-per-task=1', f'--output={tmp_path}/jupyter-%j.out', SLURM/'jupyter.sbatch', cwd=ROOT,
                             env=job_env(JUPYTER_PORT=str(port), LOGIN_HOST='login.example.org', TUNNEL_USER='alice'))
        j = cluster.wait(job, timeout=90)
    log = read(tmp_path/f'jupyter-{job}.out')
    assert j['JobState'] == 'FAILED' and tunnel(tmp_path/f'jupyter-{job}.out', 'alice', 'login.example.org')[0] == port, log[-3000:]
    assert f'port {port} is not available' in log and 'is running at' not in log, log[-3000:]

def test_tensorboard_tunnel(cluster, tmp_path):
    """TensorBoard has no login: it listens on the node's 127.0.0.1 only, behind the printed ssh -J tunnel. Its log,
    under a path with a space, is private and complete; the runs folder is the script's argument."""
    logs = tmp_path/'tb logs'; logs.mkdir()
    job = cluster.sbatch('--cpus-per-task=1', f'--output={logs}/tb %j.out', SLURM/'tensorboard.sbatch', tmp_path, cwd=ROOT,
                         env=job_env(LOGIN_HOST='login.example.org', TUNNEL_USER='alice'))
    log = logs/f'tb {job}.out'
    wait_for(lambda: 'ssh -N -L' in read(log) or cluster.job(job)['JobState'] not in ('PENDING', 'RUNNING'), 60,
             f"no tunnel line:\n{read(log)}")
    port, node = tunnel(log, 'alice', 'login.example.org', via='node')
    assert node == socket.gethostname()
    wait_for(lambda: re.search(rf'TensorBoard \S+ at http://\S+:{port}/', read(log)), 60,
             f"TensorBoard not serving on {port}:\n{read(log)[-3000:]}")
    status, body = http(f'http://127.0.0.1:{port}/')     # what the tunnel's far end connects to on the node
    assert status == 200 and 'TensorBoard' in body
    assert json.loads(http(f'http://127.0.0.1:{port}/data/environment')[1])['data_location'] == str(tmp_path)
    assert_loopback_only(port)
    assert log.stat().st_mode & 0o777 == 0o600
    assert read(log).startswith('=' * 80 + f'\nimagegen-tensorboard (job {job}) on node'), read(log)[:1000]
    cluster.cmd('scancel', str(job))
    cluster.wait(job, timeout=60)
    wait_for(lambda: not job_processes(job), 30, f"job {job} left processes behind: {job_processes(job)}")
    assert not port_open(port)

FAKE_MLFLOW = """#!{python}
# Stands in for `mlflow ui` (the MLflow server is not in the dev environment): prints its arguments, serves HTTP there.
import argparse, http.server, sys
p = argparse.ArgumentParser(); p.add_argument('command'); p.add_argument('--backend-store-uri'); p.add_argument('--host')
p.add_argument('--port', type=int)
a = p.parse_args(); print('fake mlflow', *sys.argv[1:], flush=True)
http.server.HTTPServer((a.host, a.port), http.server.SimpleHTTPRequestHandler).serve_forever()
"""

def test_mlflow_loopback_by_default_all_interfaces_on_request(cluster, tmp_path):
    """mlflow.sbatch (with a stand-in `mlflow` that serves where it is told): by default on the node's 127.0.0.1 behind
    an ssh -J tunnel; TUNNEL_VIA=login (sites without ssh to nodes) on every interface behind a login-host tunnel;
    any other TUNNEL_VIA stops the job before a server starts."""
    fake_bin = tmp_path/'bin'; fake_bin.mkdir()
    (fake_bin/'mlflow').write_text(FAKE_MLFLOW.format(python=sys.executable)); (fake_bin/'mlflow').chmod(0o755)
    env = job_env(ACTIVATE=f'export PATH={fake_bin}:{BIN}:$PATH', LOGIN_HOST='login.example.org', TUNNEL_USER='alice',
                  MLFLOW_TRACKING_URI=f'sqlite:///{tmp_path}/mlruns.db')
    jobs = {via: cluster.sbatch('--cpus-per-task=1', f'--output={tmp_path}/mlflow {via}.out', SLURM/'mlflow.sbatch', cwd=ROOT,
                                env={**env, 'TUNNEL_VIA': via})
            for via in ('', 'login', 'both')}
    log = {via: tmp_path/f'mlflow {via}.out' for via in jobs}
    for via in ('', 'login'):
        wait_for(lambda: 'fake mlflow' in read(log[via]) or cluster.job(jobs[via])['JobState'] not in ('PENDING', 'RUNNING'),
                 60, f"no server started:\n{read(log[via])}")
    port, node = tunnel(log[''], 'alice', 'login.example.org', via='node')
    wait_for(lambda: port_open(port), 30, f"nothing listens on {port}")
    assert_loopback_only(port)
    served = f'fake mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlruns.db --host 127.0.0.1 --port {port}'
    assert served in read(log['']), read(log[''])
    port, _ = tunnel(log['login'], 'alice', 'login.example.org', via='login')
    wait_for(lambda: port_open(port), 30, f"nothing listens on {port}")
    assert listening_on(port) == {'0.0.0.0'} and all(port_open(port, a) for a in outside_addresses() if '.' in a)
    assert 'anyone who can reach' in read(log['login']) and log['login'].stat().st_mode & 0o777 == 0o600
    assert cluster.wait(jobs['both'], timeout=60)['JobState'] == 'FAILED'
    assert 'TUNNEL_VIA=both: use TUNNEL_VIA=node' in read(log['both']) and 'fake mlflow' not in read(log['both'])
    for job in jobs.values(): cluster.cmd('scancel', str(job))
    for job in jobs.values(): wait_for(lambda: not job_processes(job), 30, f"job {job} left processes behind")

def test_train_one_node_two_processes(cluster, shapes, tmp_path):
    out, log = tmp_path/'run', tmp_path/'train.out'
    job = train(cluster, out, shapes, log, '--cpus-per-task=2', env={'SBATCH_GRES': 'gpu:2'})
    j = cluster.wait(job, timeout=180)
    assert j['JobState'] == 'COMPLETED' and j['ExitCode'] == '0:0', read(log)[-4000:]
    assert j['TresPerNode'] == 'gres:gpu:2'                      # SBATCH_GRES overrode the script's --gres=gpu:4
    assert '1 node(s) n1 x 2 process(es)' in read(log) and 'launcher on n1: machine_rank 0 of 1' in read(log)
    st = trainer_state(out, 4)
    assert st['step'] == 4 and st['num_processes'] == 2
    assert (out/'model'/'model_index.json').exists()
    assert not job_processes(job)

@pytest.mark.slow   # one-node, two-node, preemption and scancel jobs stay in the default run
def test_two_one_node_jobs_share_a_host(cluster, shapes, tmp_path):
    "n1 and n2 are one machine here, as two jobs on one GPU node are: each job's rendezvous must use its own port."
    jobs = {}
    for node in ('n1', 'n2'):
        out, log = tmp_path/node/'run', tmp_path/node/'train.out'
        (tmp_path/node).mkdir()
        jobs[node] = (train(cluster, out, shapes, log, f'--nodelist={node}', '--cpus-per-task=2', steps=30,
                            env={'SBATCH_GRES': 'gpu:2'}), out, log)
    for node, (job, out, log) in jobs.items():
        j = cluster.wait(job, timeout=240)
        assert j['JobState'] == 'COMPLETED' and j['ExitCode'] == '0:0', read(log)[-4000:]
        assert 'address already in use' not in read(log).lower()
        assert trainer_state(out, 30)['num_processes'] == 2

def test_train_two_nodes_c10d(cluster, shapes, tmp_path):
    out, log = tmp_path/'run', tmp_path/'train.out'
    job = train(cluster, out, shapes, log, '--nodes=2', '--cpus-per-task=2', env={'SBATCH_GRES': 'gpu:1', 'LOGLEVEL': 'INFO'})
    ranks = {}   # node -> the --machine_rank its accelerate launcher really got (read from /proc while it runs)
    def launchers_seen():
        for p in job_processes(job):
            if m := re.search(r'accelerate launch --machine_rank (\d+)', p): ranks[p.split()[0]] = m[1]
        return cluster.job(job)['JobState'] not in ('PENDING', 'RUNNING', 'CONFIGURING')
    wait_for(launchers_seen, 240, "two-node training did not finish", every=0.2)
    j = cluster.job(job)
    assert j['JobState'] == 'COMPLETED' and j['ExitCode'] == '0:0' and j['NodeList'] == 'n[1-2]', read(log)[-4000:]
    text = read(log)
    assert 'launcher on n1: machine_rank 0 of 2' in text and 'launcher on n2: machine_rank 1 of 2' in text, text[-4000:]
    # one rank per node; a launcher's forked child shows the launcher's command line until it execs, so a rank can be seen twice
    assert sorted(set(ranks.values())) == ['0', '1'], ranks
    # both launchers met at the c10d rendezvous on the first node: one group of two, ranks 0 and 1
    assert sorted(re.findall(r'group_rank=(\d+)', text)) == ['0', '1'] and text.count('group_world_size=2') == 2, text[-4000:]
    st = trainer_state(out, 4)
    assert st['step'] == 4 and st['num_processes'] == 2
    assert not job_processes(job)

def test_preemption_checkpoints_requeues_and_resumes(cluster, shapes, tmp_path):
    out, log, steps = tmp_path/'run', tmp_path/'train.out', 40
    job = train(cluster, out, shapes, log, '--cpus-per-task=2', steps=steps, env={'SBATCH_GRES': 'gpu:2'})
    progress = lambda: [int(s) for s in re.findall(rf'\| +(\d+)/{steps} ', read(log))]
    wait_for(lambda: any(s >= 3 for s in progress()), 180, f"training made no progress:\n{read(log)[-3000:]}")
    cluster.cmd('scancel', '--batch', '--signal=USR1', str(job))     # what --signal=B:USR1@300 does before the time limit
    # requeued, it waits cred_expire (here 10 s; Slurm's default 120 s) before it starts again
    j = cluster.wait(job, ('COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT'), timeout=180)
    text = read(log)
    assert j['JobState'] == 'COMPLETED' and j['ExitCode'] == '0:0' and j['Restarts'] == '1', text[-4000:]
    stop = int(re.search(r'stopped by SIGUSR1 at step (\d+); checkpoint (\S+); exiting with code 75', text)[1])
    assert 3 <= stop < steps and trainer_state(out, stop)['step'] == stop
    first, second = text.split(f'job {job} restart 1:')
    assert f'requeueing job {job}' in first and f'job {job} restart 0:' in first
    assert re.search(r'exitcode\s*: 75', first), first[-3000:]   # the launcher outlived the signal and saw both ranks exit 75
    resumed = [int(s) for s in re.findall(rf'\| +(\d+)/{steps} ', second)]
    assert resumed[0] == stop and resumed[-1] == steps, resumed    # the requeued run started from the checkpoint
    assert trainer_state(out, steps)['step'] == steps and (out/'checkpoints'/'latest').read_text().strip() == f'step_{steps:08d}'
    assert not job_processes(job)

def test_scancel_training_leaves_no_process(cluster, shapes, tmp_path):
    out, log, steps = tmp_path/'run', tmp_path/'train.out', 400
    job = train(cluster, out, shapes, log, '--cpus-per-task=2', steps=steps, env={'SBATCH_GRES': 'gpu:2'})
    wait_for(lambda: re.search(rf'\| +[2-9]/{steps} ', read(log)), 180, f"training made no progress:\n{read(log)[-3000:]}")
    assert len([p for p in job_processes(job) if 'train_ldm.py' in p]) >= 3     # launcher + 2 training processes
    cluster.cmd('scancel', str(job))
    assert cluster.wait(job, timeout=60)['JobState'] == 'CANCELLED'
    wait_for(lambda: not job_processes(job), 30, f"job {job} left processes behind: {job_processes(job)}")
    assert 'stopped by SIGTERM' in read(log) and 'requeueing' not in read(log)     # checkpointed, and stays cancelled
