"""The job scripts in slurm/ on a real Slurm cluster started on this host (Debian's slurmctld/slurmd/munge, two fake
nodes with two fake GPUs each): JupyterLab and TensorBoard behind the printed tunnel port, single- and two-node
training with accelerate (gloo CPU processes), preemption -> checkpoint -> requeue -> resume, and no process left
behind by scancel. Needs root (the daemons, the fake GPU devices) and apt when Slurm is not installed."""
import json, os, re, socket, sys, time, urllib.error, urllib.request
from pathlib import Path
import pytest
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

def port_open(port:int) -> bool:
    with socket.socket() as s: return s.connect_ex(('127.0.0.1', port)) == 0

def tunnel(log:Path, user:str, login:str) -> tuple[int, str]:
    "Port and node of the printed `ssh -N -L localhost:PORT:NODE:PORT USER@LOGIN` line."
    m = re.search(rf'ssh -N -L localhost:(\d+):(\S+):(\d+) {user}@{login}\n', read(log))
    assert m and m[1] == m[3], read(log)[-3000:]
    return int(m[1]), m[2]

def train(cluster, out:Path, shapes:Path, log:Path, *sbatch_args, steps:int=4, env:dict|None=None) -> int:
    args = ['--output_dir', out, '--dataset', shapes, '--max_steps', steps, '--batch_size', 4, '--tracker', 'none',
            '--checkpoint_every', 1000, '--warmup_steps', 0]
    return cluster.sbatch(*sbatch_args, f'--output={log}', SLURM/'train.sbatch', *args, env=job_env(**(env or {})), cwd=ROOT)

def trainer_state(out:Path, step:int) -> dict:
    return json.loads((out/'checkpoints'/f'step_{step:08d}'/'trainer_state.json').read_text())

def test_jupyter_tunnel_token_and_scancel(cluster, tmp_path):
    log = tmp_path/'jupyter-%j.out'
    job = cluster.sbatch('--cpus-per-task=1', f'--output={log}', SLURM/'jupyter.sbatch', cwd=ROOT,
                         env=job_env(LOGIN_HOST='login.example.org', TUNNEL_USER='alice', NOTEBOOK_DIR=str(tmp_path)))
    log = tmp_path/f'jupyter-{job}.out'
    j = cluster.wait(job, ('RUNNING', 'FAILED', 'CANCELLED', 'COMPLETED'), timeout=60)
    assert j['JobState'] == 'RUNNING' and j['TresPerNode'] == 'gres:gpu:1', (j, read(log))   # the script's --gres line
    wait_for(lambda: 'Jupyter Server' in read(log) and 'is running at' in read(log), 90, f"JupyterLab not serving:\n{read(log)[-3000:]}")
    assert log.stat().st_mode & 0o777 == 0o600, oct(log.stat().st_mode)
    port, node = tunnel(log, 'alice', 'login.example.org')
    assert node == socket.gethostname()
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
    log = tmp_path/'tb-%j.out'
    job = cluster.sbatch('--cpus-per-task=1', f'--output={log}', SLURM/'tensorboard.sbatch', cwd=ROOT,
                         env=job_env(LOGDIR=str(tmp_path), LOGIN_HOST='login.example.org', TUNNEL_USER='alice'))
    log = tmp_path/f'tb-{job}.out'
    wait_for(lambda: re.search(r'ssh -N -L', read(log)), 60, f"no tunnel line:\n{read(log)}")
    port, _ = tunnel(log, 'alice', 'login.example.org')
    wait_for(lambda: port_open(port), 60, f"TensorBoard not listening on {port}:\n{read(log)[-3000:]}")
    status, body = http(f'http://127.0.0.1:{port}/')
    assert status == 200 and 'TensorBoard' in body
    assert log.stat().st_mode & 0o777 == 0o600
    cluster.cmd('scancel', str(job))
    cluster.wait(job, timeout=60)
    wait_for(lambda: not job_processes(job), 30, f"job {job} left processes behind: {job_processes(job)}")
    assert not port_open(port)

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
    assert sorted(ranks.values()) == ['0', '1'], ranks
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
