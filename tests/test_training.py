"Tests of the shared training loop (imagegen.training.*): tiny models, CPU, synthetic data."
import json, os, signal, subprocess, sys, textwrap, time, warnings
from pathlib import Path

import numpy as np, pytest, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import two_ranks
from imagegen.config import ConfigError
from imagegen.training.checkpoints import EXIT_PREEMPTED, Preempted, latest_checkpoint, list_checkpoints, save_checkpoint
from imagegen.training.loop import NonFiniteLossError, TrainConfig, Trainer, make_accelerator, train

ROOT = Path(__file__).resolve().parents[1]


class Regression:
    "MLP fitting a random linear map; dropout and noisy targets make the loss depend on the global RNG."
    def __init__(self, d=8, dropout=0.1):
        torch.manual_seed(0)
        self.trainable = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, d))
        self.trainer, self.hook = None, None
    def loss(self, model, batch):
        if self.hook: self.hook(self)
        x, y = batch
        return {'loss': ((model(x) - (y + 0.01*torch.randn_like(y)))**2).mean(), 'mean_x': x.mean()}


def data(n=40, d=8, bs=4, shuffle=True):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d, generator=g)
    return DataLoader(TensorDataset(x, x @ torch.randn(d, d, generator=g)), batch_size=bs, shuffle=shuffle)


def cfg(tmp, **kw):
    base = dict(output_dir=str(tmp), max_steps=12, lr=1e-2, lr_scheduler='cosine', warmup_steps=2, tracker='none',
                checkpoint_every=None, log_every=1)
    return TrainConfig(**{**base, **kw})


def params(model): return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_loss_goes_down(tmp_path):
    res = train(Regression(dropout=0.0), data(), cfg(tmp_path, max_steps=40, lr=2e-2))
    l = res['losses']
    assert np.mean(l[-5:]) < 0.5 * np.mean(l[:5]), l
    assert res['status'] == 'finished' and res['step'] == 40
    assert (tmp_path/'model'/'model.safetensors').exists()
    info = json.loads((tmp_path/'run_info.json').read_text())
    assert info['config']['train']['max_steps'] == 40 and 'commit' in info['git'] and info['imagegen_version']


def test_ema_changes_only_on_sync_steps(tmp_path):
    task, seen = Regression(), []
    def hook(t): seen.append((t.trainer.step, t.trainer.ema.optimization_step, params_of(t.trainer.ema.shadow_params)))
    def params_of(ps): return torch.cat([p.flatten() for p in ps]).clone()
    task.hook = hook
    task.trainer = Trainer(task, data(n=48), cfg(tmp_path, ema=True, ema_decay=0.5, grad_accum=3, max_steps=6, warmup_steps=0))
    task.trainer.fit()
    assert len(seen) == 18
    for i in range(1, 18):
        changed = not torch.equal(seen[i][2], seen[i-1][2])
        assert changed == (i % 3 == 0), f"micro-step {i}: EMA changed={changed}"
        assert seen[i][1] == seen[i][0], "EMA updates must equal optimizer updates"
    assert task.trainer.ema.optimization_step == 6


def _stop_with_signal_at(step, sig=signal.SIGUSR1):
    def hook(t):
        if t.trainer.step == step and not t.trainer._stop_signal: os.kill(os.getpid(), sig)
    return hook


@pytest.mark.parametrize('grad_accum', [1, 2])
def test_stop_and_resume_equals_uninterrupted(tmp_path, grad_accum):
    c = cfg(tmp_path/'full', grad_accum=grad_accum, ema=True, ema_decay=0.9, max_steps=14)   # 10 batches/epoch: crosses epochs
    full_task = Regression()
    full = train(full_task, data(), c)['losses']
    task = Regression()
    task.hook = _stop_with_signal_at(6)
    task.trainer = Trainer(task, data(), c.override(output_dir=str(tmp_path/'cut')))
    with pytest.raises(Preempted) as e: task.trainer.fit()
    assert e.value.code == EXIT_PREEMPTED and e.value.step == 7
    assert latest_checkpoint(tmp_path/'cut'/'checkpoints').name == 'step_00000007'
    resumed_task = Regression()
    rest = train(resumed_task, data(), c.override(output_dir=str(tmp_path/'cut')))
    assert rest['resumed_from'].endswith('step_00000007')
    np.testing.assert_allclose(task.trainer.history + rest['losses'], full, rtol=0, atol=1e-6)
    torch.testing.assert_close(params(resumed_task.trainable), params(full_task.trainable), rtol=0, atol=1e-6)


def test_checkpoint_total_limit_and_latest(tmp_path):
    train(Regression(), data(), cfg(tmp_path, max_steps=10, checkpoint_every=2, checkpoints_total_limit=2))
    assert [p.name for p in list_checkpoints(tmp_path/'checkpoints')] == ['step_00000008', 'step_00000010']
    assert (tmp_path/'checkpoints'/'latest').read_text() == 'step_00000010'
    st = json.loads((tmp_path/'checkpoints'/'step_00000010'/'trainer_state.json').read_text())
    assert st['step'] == 10 and all('loss' in m for m in st['epoch_metrics'])
    assert not any(isinstance(v, list) and len(v) >= 10 for v in st.values()), "no per-batch lists in checkpoints"


def test_exception_inside_save_keeps_previous_checkpoint(tmp_path):
    acc = make_accelerator(cfg(tmp_path))
    acc.prepare(nn.Linear(2, 2))
    save_checkpoint(acc, tmp_path, 1, {'step': 1})
    orig = acc.save_state
    def broken(path): orig(path); raise OSError('disk full')
    acc.save_state = broken
    with pytest.raises(OSError): save_checkpoint(acc, tmp_path, 2, {'step': 2})
    assert latest_checkpoint(tmp_path).name == 'step_00000001'
    acc.save_state = orig
    acc.load_state(str(latest_checkpoint(tmp_path)))


CHILD = textwrap.dedent('''
    import os, signal, sys, time, torch
    sys.path.insert(0, {tests!r})
    from test_training import Regression, data, cfg
    from imagegen.training.loop import Trainer
    import accelerate
    mode, out = sys.argv[1], sys.argv[2]
    task = Regression()
    if mode == 'kill_in_save':
        orig = accelerate.Accelerator.save_state
        def save_state(self, path, **kw):
            if 'step_00000004' in str(path):
                os.makedirs(path, exist_ok=True); open(os.path.join(path, 'partial'), 'w').write('x')
                os.kill(os.getpid(), signal.SIGKILL)
            return orig(self, path, **kw)
        accelerate.Accelerator.save_state = save_state
        c = cfg(out, max_steps=6, checkpoint_every=2)
    else:
        def slow(t):
            if t.trainer.step == 3: open(os.path.join(out, 'running'), 'w').write('3')
            time.sleep(0.05)
        task.hook = slow
        c = cfg(out, max_steps=100000)
    task.trainer = Trainer(task, data(), c)
    task.trainer.fit()
''')


def _child(tmp_path, mode):
    script = tmp_path/'child.py'
    script.write_text(CHILD.format(tests=str(ROOT/'tests')))
    out = tmp_path/'run'
    out.mkdir()
    return subprocess.Popen([sys.executable, str(script), mode, str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), out


def test_kill_while_saving_keeps_latest_loadable(tmp_path):
    p, out = _child(tmp_path, 'kill_in_save')
    log = p.communicate(timeout=240)[0].decode()
    assert p.returncode == -signal.SIGKILL, log
    ck = out/'checkpoints'
    assert latest_checkpoint(ck).name == 'step_00000002'
    assert (ck/'.tmp-step_00000004').exists()
    res = train(Regression(), data(), cfg(out, max_steps=6, checkpoint_every=2))
    assert res['resumed_from'].endswith('step_00000002') and res['step'] == 6
    assert not (ck/'.tmp-step_00000004').exists()


def test_sigterm_checkpoints_and_exits_with_requeue_code(tmp_path):
    p, out = _child(tmp_path, 'sigterm')
    t0 = time.time()
    while not (out/'running').exists():
        assert p.poll() is None, p.communicate()[0].decode()
        assert time.time() - t0 < 240, 'child never started training'
        time.sleep(0.1)
    os.kill(p.pid, signal.SIGTERM)
    log = p.communicate(timeout=120)[0].decode()
    assert p.returncode == EXIT_PREEMPTED, log
    ck = latest_checkpoint(out/'checkpoints')
    step = json.loads((ck/'trainer_state.json').read_text())['step']
    assert 3 <= step < 100000 and ck.name == f'step_{step:08d}'
    assert 'stopped by SIGTERM' in log


def test_nan_guard_skips_then_aborts(tmp_path):
    calls = {'n': 0}
    class Flaky(Regression):
        def __init__(self, bad): super().__init__(); self.bad = bad
        def loss(self, model, batch):
            calls['n'] += 1
            l = super().loss(model, batch)['loss']
            return l * float('nan') if calls['n'] in self.bad else l
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        task = Flaky({3})
        res = train(task, data(), cfg(tmp_path/'a', max_steps=8))
        assert res['bad_steps'] == 1 and res['step'] == 8
        assert torch.isfinite(params(task.trainable)).all()
        calls['n'] = 0
        task = Flaky(set(range(4, 100)))
        with pytest.raises(NonFiniteLossError, match='nan_max_consecutive=2'):
            train(task, data(), cfg(tmp_path/'b', max_steps=20, nan_max_consecutive=2))
        assert torch.isfinite(params(task.trainable)).all()


def test_bf16_keeps_fp32_weights_and_fp16_weights_rejected(tmp_path):
    task = Regression()
    train(task, data(), cfg(tmp_path/'a', max_steps=3, mixed_precision='bf16'))
    assert all(p.dtype == torch.float32 for p in task.trainable.parameters())
    task = Regression(); task.trainable.half()
    with pytest.raises(ConfigError, match='float32'): train(task, data(), cfg(tmp_path/'b', max_steps=1))


def test_tensorboard_logs_and_sample_grids(tmp_path):
    from PIL import Image
    class WithSamples(Regression):
        def sample(self, n, step):
            assert not self.trainable.training
            return [Image.new('RGB', (8, 8), (step*10 % 255, 0, 0))] * n
    train(WithSamples(), data(), cfg(tmp_path, max_steps=4, tracker='tensorboard', sample_every=2, ema=True, run_name='r1'))
    assert sorted(p.name for p in (tmp_path/'samples').iterdir()) == ['step_00000002.png', 'step_00000004.png']
    assert list((tmp_path/'logs'/'r1').rglob('events.out.tfevents*'))


def test_config_errors_and_missing_tracker():
    with pytest.raises(ConfigError, match='lr_scheduler'): TrainConfig(lr_scheduler='cosine_annealing')
    with pytest.raises(ConfigError, match="did you mean 'grad_accum'"): TrainConfig().override(grad_acum=2)
    import importlib.util
    if importlib.util.find_spec('mlflow') is None:
        with pytest.raises(ConfigError, match='pip install'): make_accelerator(TrainConfig(tracker='mlflow'))


# ---- two ranks (gloo on CPU) through accelerate.debug_launcher ----

def _two_rank_run(out, max_steps, resume_ok):
    from accelerate import PartialState
    task = Regression()
    c = cfg(out, max_steps=max_steps, checkpoint_every=2, grad_accum=2, ema=True, ema_decay=0.9)
    res = train(task, data(n=48), c)
    rank = PartialState().process_index
    torch.save({'params': params(task.trainable), 'losses': res['losses'], 'resumed_from': res['resumed_from']}, Path(out)/f'rank{rank}.pt')


LAUNCH = textwrap.dedent('''
    import sys
    sys.path.insert(0, {tests!r})
    from test_training import _two_rank_run
    from accelerate import debug_launcher
    debug_launcher(_two_rank_run, args=({out!r}, 4, True), num_processes=2)
''')


def test_two_ranks_identical_params_and_resume_with_one(tmp_path):
    # debug_launcher forks; forking this pytest process after torch ran threads here can deadlock, so launch from a fresh one
    script = tmp_path/'launch.py'
    script.write_text(LAUNCH.format(tests=str(ROOT/'tests'), out=str(tmp_path)))
    p = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    r0, r1 = (torch.load(tmp_path/f'rank{i}.pt') for i in (0, 1))
    torch.testing.assert_close(r0['params'], r1['params'], rtol=0, atol=0)
    assert r0['losses'] == r1['losses'], 'logged losses are averaged across ranks'
    assert not torch.equal(r0['params'], params(Regression().trainable)), 'parameters did not change'
    # the 2-rank checkpoint resumes in one process
    res = train(Regression(), data(n=48), cfg(tmp_path, max_steps=6, checkpoint_every=2, grad_accum=2, ema=True, ema_decay=0.9))
    assert res['resumed_from'].endswith('step_00000004') and res['step'] == 6


def _two_rank_late_signal(out):
    "Rank 0's stop flag is set just after an update's all-reduce, the moment a signal handler can fire there."
    task = Regression()
    trainer = Trainer(task, data(n=48), cfg(out, max_steps=10))
    rank = trainer.acc.process_index   # after the Trainer: its Accelerator sets up the process group
    update = trainer._update
    def late_signal(*a, **kw):
        logs = update(*a, **kw)
        if rank == 0 and trainer.step == 3: trainer._stop_signal = int(signal.SIGUSR1)
        return logs
    trainer._update = late_signal
    try: trainer.fit(); stopped = None
    except Preempted as e: stopped = e.step
    torch.save({'stopped': stopped, 'params': params(task.trainable)}, Path(out)/f'stop{rank}.pt')


def test_two_ranks_stop_after_the_same_update_whenever_the_signal_lands(tmp_path):
    two_ranks(__file__, '_two_rank_late_signal', tmp_path, timeout=150)   # the previous loop hung here
    r0, r1 = (torch.load(tmp_path/f'stop{i}.pt') for i in (0, 1))
    assert r0['stopped'] == r1['stopped'] == 4, (r0['stopped'], r1['stopped'])   # the flag went through step 4's all-reduce
    torch.testing.assert_close(r0['params'], r1['params'], rtol=0, atol=0)
    assert latest_checkpoint(tmp_path/'checkpoints').name == 'step_00000004'


def test_mlflow_run_resumed_after_stop_is_the_same_run(tmp_path):
    "Stop at step 7, resume: one MLflow run (the id kept in tracker.json), whose loss curve covers steps 1..14 once."
    mlflow = pytest.importorskip('mlflow')
    uri = f"sqlite:///{tmp_path/'mlruns.db'}"
    c = cfg(tmp_path/'run', tracker='mlflow', tracking_uri=uri, experiment='resume-test', max_steps=14, run_name='r',
            tags={'phase': 'test'})
    task = Regression()
    task.hook = _stop_with_signal_at(6)
    task.trainer = Trainer(task, data(), c)
    with pytest.raises(Preempted): task.trainer.fit()
    first = json.loads((tmp_path/'run'/'tracker.json').read_text())
    res = train(Regression(), data(), c)
    second = json.loads((tmp_path/'run'/'tracker.json').read_text())
    assert res['resumed_from'] and first['run_id'] == second['run_id']
    client = mlflow.tracking.MlflowClient(uri)
    exp = client.get_experiment_by_name('resume-test')
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [first['run_id']]
    steps = sorted(m.step for m in client.get_metric_history(first['run_id'], 'loss'))
    assert steps[-1] == 14 and set(range(1, 15)) <= set(steps)
    assert runs[0].data.tags['phase'] == 'test' and runs[0].data.params['config/train/max_steps'] == '14'


def test_fresh_run_in_new_folder_is_a_new_mlflow_run(tmp_path):
    mlflow = pytest.importorskip('mlflow')
    uri = f"sqlite:///{tmp_path/'mlruns.db'}"
    ids = [train(Regression(), data(), cfg(tmp_path/d, tracker='mlflow', tracking_uri=uri, max_steps=2)) and
           json.loads((tmp_path/d/'tracker.json').read_text())['run_id'] for d in ('a', 'b')]
    assert ids[0] != ids[1]
