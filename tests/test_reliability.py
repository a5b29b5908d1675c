"Faults a long run meets (planted or damaged checkpoints, empty data, NaN gradients, changed settings): each is refused early with a clear message, or survived."
import json, os, pickle, warnings
from pathlib import Path

import numpy as np, pytest, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from imagegen.config import ConfigError
from imagegen.training.checkpoints import CheckpointError, Preempted, latest_checkpoint
from imagegen.training.loop import NonFiniteLossError, Trainer, train
from test_training import Regression, _stop_with_signal_at, cfg, data


class Payload:
    "What an attacker plants in a checkpoint: unpickling it creates `marker`."
    def __init__(self, marker): self.marker = str(marker)
    def __reduce__(self): return (Path.touch, (Path(self.marker),))


def finished_run(tmp_path, **kw):
    c = cfg(tmp_path/'run', checkpoint_every=2, max_steps=4, **kw)
    train(Regression(), data(), c)
    return c, tmp_path/'run'/'checkpoints'


@pytest.mark.parametrize('planted', ['custom_checkpoint_0.pkl', 'random_states_0.pkl', 'optimizer.bin'])
def test_code_planted_in_a_checkpoint_never_runs(tmp_path, planted):
    c, ck = finished_run(tmp_path, ema=True)
    marker = tmp_path/'PWNED'
    for step in ('step_00000002', 'step_00000004'):
        (ck/step/planted).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=f"none is usable.*{planted}"), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        train(Regression(), data(), c.override(max_steps=6))
    assert not marker.exists()


def test_damaged_latest_checkpoint_is_named_and_the_previous_one_used(tmp_path):
    c, ck = finished_run(tmp_path)
    f = ck/'step_00000004'/'model.safetensors'
    f.write_bytes(f.read_bytes()[:100])      # truncated by a full disk or a killed copy
    with pytest.warns(UserWarning, match=r"step_00000004/model.safetensors cannot be read safely"):
        res = train(Regression(), data(), c.override(max_steps=6))
    assert res['resumed_from'].endswith('step_00000002') and res['step'] == 6
    (ck/'step_00000006'/'trainer_state.json').write_text('{"step": 6, "epo')
    with pytest.warns(UserWarning, match='trainer_state.json is damaged'):
        assert train(Regression(), data(), c.override(max_steps=8))['resumed_from'].endswith('step_00000004')
    (ck/'step_00000008'/'model.safetensors').unlink()                      # the weights gone from the newest: the one before it
    with pytest.warns(UserWarning, match=r'step_00000008 has no model weights'):
        assert train(Regression(), data(), c.override(max_steps=10))['resumed_from'].endswith('step_00000006')


def test_latest_pointing_at_nothing_refuses_to_restart_from_zero(tmp_path):
    c = cfg(tmp_path/'run', checkpoint_every=2, max_steps=2)
    train(Regression(), data(), c)
    import shutil
    shutil.rmtree(tmp_path/'run'/'checkpoints'/'step_00000002')
    with pytest.raises(CheckpointError, match='none is usable'), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        train(Regression(), data(), c.override(max_steps=4))


def test_dataset_smaller_than_a_batch_is_an_error_not_a_hang(tmp_path):
    x = torch.randn(3, 8)
    dl = DataLoader(TensorDataset(x, x), batch_size=4, drop_last=True)
    with pytest.raises(ConfigError, match='fewer samples than one batch'):
        train(Regression(), dl, cfg(tmp_path, max_steps=5))


class NaNGrad(Regression):
    "Finite loss, NaN gradient (d sqrt(x)/dx at 0 times 0) from step `at` on."
    def __init__(self, at): super().__init__(); self.at, self.calls = at, 0
    def loss(self, model, batch):
        out = super().loss(model, batch)
        self.calls += 1
        if self.calls > self.at: out['loss'] = out['loss'] + 0 * torch.sqrt(0 * model[0].weight.sum())
        return out


def test_nan_gradient_without_clipping_never_reaches_the_weights(tmp_path):
    task = NaNGrad(at=3)
    with pytest.raises(NonFiniteLossError, match='nan_max_consecutive=2'), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        train(task, data(), cfg(tmp_path, max_grad_norm=None, nan_max_consecutive=2, checkpoint_every=1))
    assert all(torch.isfinite(p).all() for p in task.trainable.parameters())
    last = latest_checkpoint(tmp_path/'checkpoints')
    from safetensors.torch import load_file
    assert last is not None and all(torch.isfinite(t).all() for t in load_file(str(last/'model.safetensors')).values())


def test_resume_applies_a_changed_learning_rate_and_says_so(tmp_path, capfd):
    c = cfg(tmp_path/'run', max_steps=12, lr=1e-2, lr_scheduler='constant', warmup_steps=0)
    task = Regression(); task.hook = _stop_with_signal_at(5)
    task.trainer = Trainer(task, data(), c)
    with pytest.raises(Preempted): task.trainer.fit()
    capfd.readouterr()
    t = Trainer(Regression(), data(), c.override(lr=2e-2))
    t._start_logging(); t._resume()
    assert t.sched.get_last_lr() == pytest.approx([2e-2] * len(t.sched.get_last_lr()))
    assert all(g['lr'] == pytest.approx(2e-2) for g in t.opt.optimizer.param_groups)
    assert 'train.lr: 0.01 -> 0.02 (applied' in capfd.readouterr().err


def test_max_steps_below_the_checkpoint_is_refused_and_a_finished_run_is_kept(tmp_path, capfd):
    c, ck = finished_run(tmp_path)
    with pytest.raises(ConfigError, match='max_steps=2 but .* is at step 4'):
        train(Regression(), data(), c.override(max_steps=2))
    model = tmp_path/'run'/'model'/'model.safetensors'
    before = model.stat().st_mtime_ns
    res = train(Regression(), data(), c)          # the same command again (a requeue after the end)
    assert res['step'] == 4 and model.stat().st_mtime_ns == before
    assert 'already trained to step 4' in capfd.readouterr().err


SLOW_RUN = '''
import sys, time
sys.path.insert(0, {tests!r})
from test_training import Regression, data, cfg
from imagegen.training.loop import train
t = Regression(); t.hook = lambda _: time.sleep(0.05)
train(t, data(), cfg({out!r}, max_steps=60, checkpoint_every=5))
'''


def test_two_runs_on_one_folder_the_second_is_refused(tmp_path):
    import subprocess, sys, time
    out = tmp_path/'run'
    child = subprocess.Popen([sys.executable, '-c', SLOW_RUN.format(tests=str(Path(__file__).parent), out=str(out))],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            if (out/'checkpoints'/'latest').exists(): break
            time.sleep(0.1)
        assert child.poll() is None, 'the first run ended before the test could overlap it'
        from imagegen.training.checkpoints import RunLocked
        with pytest.raises(RunLocked, match=f"pid {child.pid}"):
            train(Regression(), data(), cfg(out, max_steps=60, checkpoint_every=5))
        assert child.wait(timeout=300) == 0                    # the first run was not disturbed
    finally:
        if child.poll() is None: child.kill()
    assert json.loads((out/'checkpoints'/'step_00000060'/'trainer_state.json').read_text())['step'] == 60
    assert not (out/'.lock').exists()
    res = train(Regression(), data(), cfg(out, max_steps=60, checkpoint_every=5))   # free again once it ended
    assert res['step'] == 60


USER_ERRORS = [
    (['--learning_rate', '-1'], 'TrainConfig.lr=-1.0: must be a positive, finite number'),
    (['--learning_rate', 'nan'], "TrainConfig.lr: 'nan' is not a finite number"),
    (['--lr_warmup_steps', '-10'], 'TrainConfig.warmup_steps=-10: must be >= 0'),
    (['--ema_decay', '2.0'], 'TrainConfig.ema_decay=2.0: must be in [0, 1]'),
    (['--max_grad_norm', '-1'], 'TrainConfig.max_grad_norm=-1.0'),
    (['--resolution', '0'], 'LDMConfig.resolution=0: must be a positive multiple of 8'),
    (['--max_step', '3'], 'unrecognized arguments: --max_step'),           # a typo is not a prefix of --max_steps
    (['--output_dir', ''], 'TrainConfig.output_dir=\'\': must name a folder'),
    (['--train_data_dir', './no/such/folder'], 'dataset ./no/such/folder does not exist (a local path, not a Hub id'),
]

@pytest.mark.parametrize('args, expect', USER_ERRORS)
def test_user_errors_are_one_line_and_exit_2(args, expect, user_errors):
    p = user_errors[tuple(args)]
    assert p['returncode'] == 2 and expect in p['stderr'], p['stderr'][-3000:]
    assert 'Traceback' not in p['stderr'], p['stderr']


@pytest.fixture(scope='module')
def user_errors(tmp_path_factory):
    "train_ldm.py with each bad argument of USER_ERRORS, all in one interpreter (conftest.run_many)."
    from conftest import run_many
    out = tmp_path_factory.mktemp('user_errors')/'out'
    calls = [('scripts/train_ldm.py', ['--output_dir', out, '--report_to', 'none', *a], {'HF_HUB_OFFLINE': '1'}) for a, _ in USER_ERRORS]
    return {tuple(a): r for (a, _), r in zip(USER_ERRORS, run_many(calls))}


def test_a_user_error_in_its_own_process(tmp_path):
    "One of the above as a user meets it: a fresh interpreter exits 2 with one line."
    import subprocess, sys
    from conftest import ROOT
    p = subprocess.run([sys.executable, 'scripts/train_ldm.py', '--output_dir', str(tmp_path/'out'), '--learning_rate', '-1'],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, 'HF_HUB_OFFLINE': '1'})
    assert p.returncode == 2 and 'Traceback' not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1] == 'train_ldm.py: error: TrainConfig.lr=-1.0: must be a positive, finite number.', p.stderr


def test_unwritable_or_full_output_dir_is_refused_before_training(tmp_path, monkeypatch):
    from imagegen.config import UserError
    (tmp_path/'a_file').write_text('x')
    with pytest.raises(UserError, match='cannot write in output_dir'):
        train(Regression(), data(), cfg(tmp_path/'a_file'/'run'))
    import shutil
    monkeypatch.setattr(shutil, 'disk_usage', lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    with pytest.raises(UserError, match='has 1000 B free, but each checkpoint needs about'):
        train(Regression(), data(), cfg(tmp_path/'run'))
    assert not (tmp_path/'run'/'.lock').exists() and not (tmp_path/'run'/'checkpoints').exists()


def test_a_full_disk_while_checkpointing_is_one_message_and_the_run_resumes(tmp_path, monkeypatch):
    "torch's serializer reports a full disk as a RuntimeError ('file write failed'): the loop names it, keeps what it wrote, and the same command resumes."
    import imagegen.training.loop as loop
    from imagegen.training.checkpoints import DiskFullError
    real, calls = loop.save_checkpoint, []
    def full_at_second(*a, **kw):
        calls.append(1)
        if len(calls) == 2: raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0: PytorchStreamWriter failed writing file data/0: file write failed")
        return real(*a, **kw)
    monkeypatch.setattr(loop, 'save_checkpoint', full_at_second)
    c = cfg(tmp_path/'run', checkpoint_every=2, max_steps=6)
    with pytest.raises(DiskFullError, match=r"step 4: no space left for a checkpoint in .* free\). The checkpoints written before are intact \(latest: .*step_00000002\)"):
        train(Regression(), data(), c)
    monkeypatch.setattr(loop, 'save_checkpoint', real)
    res = train(Regression(), data(), c)
    assert res['resumed_from'].endswith('step_00000002') and res['step'] == 6


def shapes_folder(root, n=20):
    from imagegen.data import write_imagefolder
    from imagegen.shapes import ShapesDataset
    return write_imagefolder(ShapesDataset('train', n=n), root)


def train_script(name, *args, check=True):
    import subprocess, sys
    from conftest import ROOT
    p = subprocess.run([sys.executable, f'scripts/{name}', '--report_to', 'none', '--train_batch_size', '4', *map(str, args)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, 'HF_HUB_OFFLINE': '1'})
    if check: assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_caption_with_a_lone_surrogate_trains(tmp_path):
    root = shapes_folder(tmp_path/'data', n=16)
    lines = (root/'metadata.jsonl').read_text().splitlines()
    rec = json.loads(lines[0]); rec['text'] = 'a red \ud800 circle'; rec['captions'] = [rec['text']]
    lines[0] = json.dumps(rec)                                   # written as the escape "\ud800"
    (root/'metadata.jsonl').write_text('\n'.join(lines) + '\n')
    train_script('train_ldm.py', '--train_data_dir', root, '--max_train_steps', 2, '--output_dir', tmp_path/'run',
                 '--block_out_channels', '32,32', '--text_hidden', '32')


def test_a_few_bad_images_need_the_budget_flag(tmp_path):
    root = shapes_folder(tmp_path/'data', n=20)
    for name in ('000003.png', '000011.png'): (root/name).write_bytes(b'not a png at all')   # 10 % bad
    p = train_script('train_vae.py', '--train_data_dir', root, '--max_train_steps', 6, '--output_dir', tmp_path/'a', check=False)
    assert p.returncode == 2 and 'max_bad_frac' in p.stderr and '000003.png' in p.stderr and 'Traceback' not in p.stderr, p.stderr[-2000:]
    train_script('train_vae.py', '--train_data_dir', root, '--max_train_steps', 6, '--output_dir', tmp_path/'b', '--max_bad_frac', 0.2)


def test_truncated_shard_in_a_resampled_stream_counts_once_per_pass(tmp_path):
    from imagegen.data import ImageTransform, ShardSource, write_shards
    from imagegen.shapes import ShapesDataset
    paths = write_shards(ShapesDataset('train', n=64), tmp_path, samples_per_shard=16)
    paths[1].write_bytes(paths[1].read_bytes()[:3000])           # cut short
    src = ShardSource([str(p) for p in paths], ImageTransform(32), resampled=True, epoch_size=200, shuffle_buffer=1)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        n = sum(1 for _ in src)
    assert n == 200 and len(src.log.skipped) == 1 and src.log.skipped[0][0] == str(paths[1]), src.log
    src.set_epoch(1)
    assert sum(1 for _ in src) == 200 and len(src.log.skipped) == 2   # once again in the next pass, no more
    # the same through a script, with --epoch_size
    from imagegen.data import shard_pattern
    train_script('train_vae.py', '--train_data_dir', shard_pattern(paths), '--epoch_size', 32, '--max_train_steps', 4,
                 '--output_dir', tmp_path/'run', '--max_bad_frac', 0.5)


def test_images_without_a_metadata_row_are_reported(tmp_path, caplog):
    from imagegen.data import ImageFolderSource, ImageTransform
    from PIL import Image
    root = shapes_folder(tmp_path/'data', n=4)
    Image.new('RGB', (32, 32)).save(root/'stray.png')
    with caplog.at_level('WARNING', logger='imagegen.data'):
        src = ImageFolderSource(root, ImageTransform(32))
    assert src.unlisted == ['stray.png'] and 'stray.png' in caplog.text and len(src) == 4


def test_bad_samples_are_totalled_over_ranks_and_workers(tmp_path):
    "2 ranks x 2 loader workers, one epoch over 40 images of which 3 are bad: the run counts exactly 3."
    from conftest import launch
    root = shapes_folder(tmp_path/'data', n=40)
    for name in ('000002.png', '000017.png', '000033.png'): (root/name).write_bytes(b'\x89PNG broken')
    out = tmp_path/'run'
    p = launch('scripts/train_vae.py', '--train_data_dir', root, '--output_dir', out, '--max_train_steps', 5, '--train_batch_size', 4,
               '--dataloader_num_workers', 2, '--max_bad_frac', 0.1, '--report_to', 'none', '--checkpointing_steps', 5,
               '--base_channels', 16)
    st = json.loads((out/'checkpoints'/'step_00000005'/'trainer_state.json').read_text())
    assert (st['global_batches_in_epoch'], st['bad_samples']) == (10, 3), st   # all 40 items asked for once, 3 of them bad
    assert '3 bad sample(s) skipped in this run' in p.stderr
