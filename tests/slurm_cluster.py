"""A throwaway Slurm cluster on this host for the tests: munged + slurmctld + one slurmd per fake node, fake GPUs.

Everything (config, state, spool, logs, munge socket and key, fake GPU device files) lives under one folder; the
daemons are started by hand (no systemd) on free ports, so the cluster does not touch a system Slurm or munge.
Run this file directly to keep a cluster up for manual experiments: `python tests/slurm_cluster.py /tmp/slurm`."""
from __future__ import annotations
import os, pwd, random, re, shutil, signal, socket, subprocess, sys, time
from pathlib import Path

PACKAGES = ['slurmctld', 'slurmd', 'slurm-client', 'munge']
DAEMONS = ['munged', 'slurmctld', 'slurmd', 'sbatch', 'scontrol']

def missing_binaries() -> list[str]:
    return [d for d in DAEMONS if not (shutil.which(d) or Path('/usr/sbin', d).exists())]

def install_slurm() -> str|None:
    "Install Debian's Slurm + munge when missing; returns None when they are there, else why they cannot be installed."
    if not missing_binaries(): return None
    if os.geteuid() != 0: return f"Slurm/munge missing ({missing_binaries()}) and not root: run `apt-get install -y {' '.join(PACKAGES)}`"
    if not shutil.which('apt-get'): return f"Slurm/munge missing ({missing_binaries()}) and no apt-get to install {PACKAGES}"
    env = {**os.environ, 'DEBIAN_FRONTEND': 'noninteractive'}
    apt = lambda *a: subprocess.run(['apt-get', *a], env=env, capture_output=True, text=True)
    install = ['install', '-y', '-q', '-o', 'DPkg::Lock::Timeout=300', '--no-install-recommends', *PACKAGES]
    if (p := apt(*install)).returncode: apt('update', '-q'); p = apt(*install)   # no package lists yet
    if p.returncode or missing_binaries(): return f"`apt-get install {' '.join(PACKAGES)}` failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    return None

def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def _alive(pid:int) -> bool:
    "Running and not a zombie (a daemon that exited stays a zombie until reaped, so `kill -0` is not enough)."
    try: return Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0] != 'Z'
    except (FileNotFoundError, ProcessLookupError, IndexError): return False

def _sbin(name:str) -> str: return shutil.which(name) or f'/usr/sbin/{name}'

class SlurmCluster:
    "Nodes `n1..nN` (each `cpus` CPUs and `gpus` fake GPUs) in one partition `debug`, all served from this host."
    def __init__(self, root:str|Path, n_nodes:int=2, cpus:int=2, gpus:int=2, kill_wait:int=10, cred_expire:int=10):
        "`kill_wait`: seconds between SIGTERM and SIGKILL; `cred_expire`: also how long a requeued job waits (Slurm's default 120)."
        self.root, self.nodes, self.cpus, self.gpus = Path(root), [f'n{i+1}' for i in range(n_nodes)], cpus, gpus
        self.kill_wait, self.cred_expire = kill_wait, cred_expire
        self.conf, self.procs = self.root/'slurm.conf', {}

    @property
    def env(self) -> dict:
        "Environment for the Slurm client commands (and for the jobs they submit): no Slurm settings from outside."
        outside = ('SLURM_', 'SBATCH_', 'SRUN_', 'SALLOC_')
        return {**{k: v for k, v in os.environ.items() if not k.startswith(outside)}, 'SLURM_CONF': str(self.conf)}

    def _write_config(self):
        r = self.root
        for d in ['state', 'log', 'run', 'munge', *(f'spool/{n}' for n in self.nodes), *(f'dev/{n}' for n in self.nodes)]: (r/d).mkdir(parents=True, exist_ok=True)
        for n in self.nodes:
            for i in range(self.gpus):
                dev = r/'dev'/n/f'nvidia{i}'
                if not dev.exists(): os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))   # a character device, like /dev/null
        (r/'munge'/'munge.key').write_bytes(os.urandom(128)); (r/'munge'/'munge.key').chmod(0o400)
        self.ctld_port, self.node_ports = free_port(), {n: free_port() for n in self.nodes}
        nodes = '\n'.join(f"NodeName={n} NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus} RealMemory=2000 Gres=gpu:{self.gpus} State=UNKNOWN"
                          for n, p in self.node_ports.items())
        # a random first job id: job ids (and so SLURM_JOB_ID in /proc) differ between clusters running side by side
        self.conf.write_text(f"""ClusterName=imagegen-test
SlurmctldHost=localhost
SlurmctldPort={self.ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket,cred_expire={self.cred_expire}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
KillWait={self.kill_wait}
FirstJobId={random.randint(10**5, 6*10**7)}
SchedulerParameters=sched_interval=2,bf_interval=2
MinJobAge=600
{nodes}
PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")
        (r/'gres.conf').write_text('AutoDetect=off\n' + ''.join(
            f"NodeName={n} Name=gpu File={r}/dev/{n}/nvidia[0-{self.gpus-1}]\n" for n in self.nodes))

    def _daemon(self, name:str, cmd:list[str], pidfile:Path):
        p = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if p.returncode: raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stdout}{p.stderr}\n{self.logs()}")
        for _ in range(100):
            if pidfile.exists() and pidfile.read_text().strip(): break
            time.sleep(0.1)
        else: raise RuntimeError(f"{name} wrote no pid file {pidfile}\n{self.logs()}")
        self.procs[name] = int(pidfile.read_text().split()[0])

    def start(self, timeout:float=60) -> SlurmCluster:
        "Write the config, start munged, slurmctld and one slurmd per node; wait until every node is idle."
        self._write_config()
        r = self.root
        self._daemon('munged', [_sbin('munged'), '--force', f'--socket={r}/munge/munge.socket', f'--key-file={r}/munge/munge.key',
                                f'--pid-file={r}/run/munged.pid', f'--log-file={r}/log/munged.log', f'--seed-file={r}/munge/seed'],
                     r/'run'/'munged.pid')
        self._daemon('slurmctld', [_sbin('slurmctld'), '-f', str(self.conf)], r/'run'/'slurmctld.pid')
        for n in self.nodes: self._daemon(f'slurmd-{n}', [_sbin('slurmd'), '-f', str(self.conf), '-N', n], r/'run'/f'slurmd-{n}.pid')
        t0 = time.time()
        while time.time() - t0 < timeout:
            out = self.cmd('sinfo', '-h', '-N', '-o', '%N %t', check=False).stdout
            states = dict(l.split() for l in out.splitlines() if l.strip())
            if len(states) == len(self.nodes) and all(s == 'idle' for s in states.values()): return self
            time.sleep(0.5)
        raise RuntimeError(f"nodes not idle after {timeout} s: {out}\n{self.logs()}")

    def stop(self):
        "Cancel every job, stop the daemons (slurmd first, munged last) and wait until they are gone."
        if 'slurmctld' in self.procs: self.cmd('scancel', '--full', '-u', pwd.getpwuid(os.getuid()).pw_name, check=False)
        for name in [*(k for k in self.procs if k.startswith('slurmd')), 'slurmctld', 'munged']:
            pid = self.procs.pop(name, None)
            if pid is None: continue
            try: os.kill(pid, 15)
            except ProcessLookupError: continue
            for _ in range(100):
                if not _alive(pid): break
                time.sleep(0.1)
            else: os.kill(pid, 9)

    def cmd(self, *args, check=True, timeout=60) -> subprocess.CompletedProcess:
        "Run a Slurm client command against this cluster."
        p = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode: raise RuntimeError(f"{' '.join(args)} exited {p.returncode}: {p.stdout}{p.stderr}")
        return p

    def sbatch(self, *args, env:dict|None=None, cwd:str|Path|None=None) -> int:
        "Submit a batch job (extra `env` on top of the cluster's); returns the job id."
        p = subprocess.run(['sbatch', '--parsable', *map(str, args)], env={**self.env, **(env or {})}, cwd=cwd,
                           capture_output=True, text=True, timeout=60)
        if p.returncode: raise RuntimeError(f"sbatch {' '.join(map(str, args))} exited {p.returncode}: {p.stdout}{p.stderr}")
        return int(p.stdout.strip().split(';')[0])

    def job(self, job_id:int) -> dict:
        "The job's fields from `scontrol show job` (JobState, ExitCode, Restarts, NodeList, StdOut, ...)."
        out = self.cmd('scontrol', '-o', 'show', 'job', str(job_id)).stdout
        return dict(re.findall(r'(\w+)=(\S*)', out))

    def wait(self, job_id:int, states=('COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT', 'NODE_FAIL', 'OUT_OF_MEMORY'), timeout:float=120) -> dict:
        "Poll until the job is in one of `states`; returns its fields (raises with the job's fields on timeout)."
        t0 = time.time()
        while time.time() - t0 < timeout:
            j = self.job(job_id)
            if j.get('JobState') in states: return j
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout} s: {j}")

    def logs(self) -> str:
        return '\n'.join(f"--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted((self.root/'log').glob('*.log')))

def job_processes(job_id:int) -> list[str]:
    "Processes on this host whose environment holds SLURM_JOB_ID=`job_id` (the job's leftovers once it has ended)."
    found, key = [], f'SLURM_JOB_ID={job_id}'.encode()
    for d in Path('/proc').iterdir():
        if not d.name.isdigit() or not _alive(int(d.name)): continue
        try:
            if key in (d/'environ').read_bytes().split(b'\0'):
                found.append(f"{d.name}: " + (d/'cmdline').read_bytes().replace(b'\0', b' ').decode(errors='replace'))
        except (FileNotFoundError, ProcessLookupError, PermissionError): pass
    return found

if __name__ == '__main__':
    if why := install_slurm(): sys.exit(why)
    c = SlurmCluster(sys.argv[1] if len(sys.argv) > 1 else '/tmp/imagegen-slurm').start()
    print(f"cluster up: export SLURM_CONF={c.conf}   (Ctrl-C or SIGTERM stops it)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True: time.sleep(3600)
    except (KeyboardInterrupt, SystemExit): c.stop()
