"""The real scripts on 2 gloo CPU ranks (`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2`):
ranks stay in sync (parameters, EMA, text encoder), each sample is seen once per epoch, only rank 0 writes, checkpoints
move between 1 and 2 ranks, sampling and evaluation cover every rank's prompts in order. tests/dist_probe.py records
what each rank saw, held and wrote."""
import json, shutil, sys, textwrap
from pathlib import Path
import numpy as np, pytest, torch
from PIL import Image
from conftest import ROOT, run, launch, rank_records

N_TRAIN, BS = 32, 4   # an epoch is 4 steps on 2 ranks, 8 on one
LDM_ARGS = ['--batch_size', BS, '--lr', 1e-3, '--warmup_steps', 0, '--ema', '--ema_decay', 0.9, '--checkpoint_every', 2]


@pytest.fixture(scope='module')
def shapes(tmp_path_factory):
    "Shapes written by scripts/make_shapes.py: imagefolder/train (32 images) and shards/train (4 shards of 8)."
    d = tmp_path_factory.mktemp('shapes')
    run([sys.executable, 'scripts/make_shapes.py', '--out', str(d), '--n_train', str(N_TRAIN), '--n_validation', '0',
         '--n_test', '0', '--samples_per_shard', '8'])
    return d


def all_keys(folder) -> set:
    return {json.loads(l)['file_name'] for l in (Path(folder)/'metadata.jsonl').read_text().splitlines()}


def epoch_keys(rec, epoch) -> list:
    return [k for b in rec['batches'] if b['epoch'] == epoch for k in b['keys']]


def assert_once(*key_lists, expected=None):
    "No key in two lists (or twice in one); with `expected`, together they are exactly `expected`."
    keys = [k for ks in key_lists for k in ks]
    assert len(keys) == len(set(keys)), f"samples seen twice in one epoch: {sorted(k for k in set(keys) if keys.count(k) > 1)}"
    if expected is not None: assert set(keys) == set(expected), f"missing {sorted(set(expected) - set(keys))}"


def other_writes(rec) -> list:
    "What a non-main rank wrote besides its own RNG state in checkpoints (accelerate saves one per rank)."
    return [p for _, p in rec['writes'] if not Path(p).name == f"random_states_{rec['rank']}.pkl"]


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in module.parameters()])


def tfevents_pids(run_dir) -> set:
    "Process ids in the names of TensorBoard event files (events.out.tfevents.<time>.<host>.<pid>.<n>)."
    return {int(p.name.split('.')[-2]) for p in Path(run_dir, 'logs').rglob('events.out.tfevents*')}


@pytest.fixture(scope='module')
def ldm2(shapes, tmp_path_factory):
    "scripts/train_ldm.py on 2 ranks: 6 steps (one epoch and a half), EMA, TensorBoard, grids every 3, checkpoints every 2."
    d = tmp_path_factory.mktemp('ldm2')
    launch('scripts/train_ldm.py', '--output_dir', d/'run', '--dataset', shapes/'imagefolder'/'train', '--max_steps', 6,
           '--sample_every', 3, '--tracker', 'tensorboard', *LDM_ARGS, probe=d/'probe')
    return d/'run', rank_records(d/'probe', 2)


def test_ldm_ranks_hold_the_same_model(ldm2):
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer
    out, (r0, r1) = ldm2
    assert (r0['rank'], r1['rank'], r0['world_size'], r0['end_step']) == (0, 1, 2, 6)
    assert not torch.equal(r0['params_start'], r0['params']), "training did not change the UNet"
    torch.testing.assert_close(r0['params'], r1['params'], rtol=0, atol=0)
    torch.testing.assert_close(r0['ema'], r1['ema'], rtol=0, atol=0)
    assert not torch.equal(r0['ema'], r0['params']), "EMA should lag the weights"
    assert r0['losses'] == r1['losses'], "logged losses are averaged over ranks"
    # the saved model is the EMA every rank holds, with the tokenizer and text encoder every rank trained with
    torch.testing.assert_close(flat(UNet2DConditionModel.from_pretrained(out/'model', subfolder='unet')), r0['ema'], rtol=0, atol=0)
    assert r0['vocab'] == r1['vocab'] == CLIPTokenizer.from_pretrained(out/'model', subfolder='tokenizer').get_vocab()
    saved_text = flat(CLIPTextModel.from_pretrained(out/'model', subfolder='text_encoder'))
    assert torch.equal(r0['text_params'], r1['text_params']) and torch.equal(r0['text_params'], saved_text)


def test_ldm_each_sample_once_per_epoch(ldm2, shapes):
    _, (r0, r1) = ldm2
    assert [b['step'] for b in r0['batches']] == [b['step'] for b in r1['batches']] == list(range(6))
    assert_once(epoch_keys(r0, 0), epoch_keys(r1, 0), expected=all_keys(shapes/'imagefolder'/'train'))
    assert len(epoch_keys(r0, 1)) == len(epoch_keys(r1, 1)) == 2 * BS
    assert_once(epoch_keys(r0, 1), epoch_keys(r1, 1))


def test_ldm_only_main_process_writes(ldm2):
    out, (r0, r1) = ldm2
    assert other_writes(r1) == [], f"rank 1 wrote {other_writes(r1)}"
    assert any(Path(p).name == 'random_states_1.pkl' for _, p in r1['writes']), "the probe sees writes"
    wrote0 = {str(Path(p).relative_to(out)) for _, p in r0['writes'] if Path(p).is_relative_to(out)}
    assert {'run_info.json', 'checkpoints/latest', 'samples/step_00000003.png', 'samples/step_00000006.png',
            'model/unet/config.json'} <= wrote0
    assert [p.name for p in (out/'logs').iterdir()] == [json.loads((out/'run_info.json').read_text())['run_name']]
    assert tfevents_pids(out) == {r0['pid']}, "TensorBoard events come from rank 0 only"
    assert sorted(p.name for p in (out/'checkpoints').iterdir()) == ['latest', 'step_00000002', 'step_00000004', 'step_00000006']
    assert sorted(p.name for p in (out/'samples').iterdir()) == ['step_00000003.png', 'step_00000006.png']


def test_ldm_latent_cache_split_across_ranks(shapes, tmp_path):
    "--cache_latents on 2 ranks: each encodes its half into OUTPUT_DIR/encoded and trains on all of it; the resumed run reads it."
    args = ['scripts/train_ldm.py', '--output_dir', tmp_path/'run', '--dataset', shapes/'imagefolder'/'train', '--tracker', 'none',
            '--cache_latents', *LDM_ARGS]
    launch(*args, '--max_steps', 2, probe=tmp_path/'first')
    r0, r1 = rank_records(tmp_path/'first', 2)
    (enc,) = (tmp_path/'run'/'encoded').iterdir()
    meta = json.loads((enc/'meta.json').read_text())
    assert enc.name.startswith('latents-') and (meta['samples'], meta['parts']) == (N_TRAIN, ['part-00000', 'part-00001'])
    assert {Path(p).name for p in other_writes(r1)} == {'part-00001.json', 'part-00001.latent_mean.npy', 'part-00001.latent_std.npy'}
    assert not any('part-00001' in p for _, p in r0['writes'])            # rank 0 encoded only its own half
    assert_once(epoch_keys(r0, 0), epoch_keys(r1, 0))
    launch(*args, '--max_steps', 4, probe=tmp_path/'resumed')
    b0, b1 = rank_records(tmp_path/'resumed', 2)
    assert b0['start_step'] == b1['start_step'] == 2 and other_writes(b1) == []   # nothing encoded again
    assert [p.name for p in (tmp_path/'run'/'encoded').iterdir()] == [enc.name]
    assert_once(*(epoch_keys(r, 0) for r in (r0, r1, b0, b1)), expected=all_keys(shapes/'imagefolder'/'train'))


def test_checkpoints_move_between_two_ranks_and_one(ldm2, shapes, tmp_path):
    "The 2-rank run (steps 1-6) goes on in one process (7-8), then on 2 ranks again (9): each resumes where the last stopped."
    out, (r0, r1) = ldm2
    run_dir = tmp_path/'run'
    shutil.copytree(out, run_dir)
    args = ['scripts/train_ldm.py', '--output_dir', run_dir, '--dataset', shapes/'imagefolder'/'train', '--tracker', 'none', *LDM_ARGS]
    launch(*args, '--max_steps', 8, num_processes=1, probe=tmp_path/'one')
    launch(*args, '--max_steps', 9, probe=tmp_path/'two')
    (a,), (b0, b1) = rank_records(tmp_path/'one', 1), rank_records(tmp_path/'two', 2)
    for prev, nxt, step, end in ((r0, a, 6, 8), (a, b0, 8, 9), (a, b1, 8, 9)):
        assert nxt['start_step'] == step and nxt['resumed_from'].endswith(f'step_{step:08d}') and nxt['end_step'] == end
        assert [b['step'] for b in nxt['batches']] == list(range(step, end))
        torch.testing.assert_close(nxt['params_start'], prev['params'], rtol=0, atol=0)
        torch.testing.assert_close(nxt['ema_start'], prev['ema'], rtol=0, atol=0)
        assert nxt['vocab'] == r0['vocab'], "the resumed run rebuilt a different tokenizer"
    torch.testing.assert_close(b0['params'], b1['params'], rtol=0, atol=0)
    torch.testing.assert_close(b0['ema'], b1['ema'], rtol=0, atol=0)
    # epoch 1 = steps 5-6 on 2 ranks, 7-8 on one, 9 on 2 ranks: every sample once
    assert_once(*(epoch_keys(r, 1) for r in (r0, r1, a, b0, b1)), expected=all_keys(shapes/'imagefolder'/'train'))
    states = {s: json.loads((run_dir/'checkpoints'/f'step_{s:08d}'/'trainer_state.json').read_text()) for s in (8, 9)}
    assert (states[8]['num_processes'], states[9]['num_processes']) == (1, 2)


def test_vae_two_ranks(shapes, tmp_path):
    from diffusers import AutoencoderKL
    out = tmp_path/'vae'
    launch('scripts/train_vae.py', '--output_dir', out, '--dataset', shapes/'imagefolder'/'train', '--max_steps', 3,
           '--batch_size', BS, '--tracker', 'tensorboard', probe=tmp_path/'probe')
    r0, r1 = rank_records(tmp_path/'probe', 2)
    torch.testing.assert_close(r0['params'], r1['params'], rtol=0, atol=0)
    assert not torch.equal(r0['params_start'], r0['params'])
    vae = AutoencoderKL.from_pretrained(out/'model')
    torch.testing.assert_close(flat(vae), r0['params'], rtol=0, atol=0)
    assert vae.config.scaling_factor != AutoencoderKL().config.scaling_factor, "scaling factor derived from the data"
    assert_once(epoch_keys(r0, 0), epoch_keys(r1, 0))
    assert other_writes(r1) == [] and tfevents_pids(out) == {r0['pid']}


SHARD_TRAIN = textwrap.dedent('''
    "Train a tiny model with the shared loop on a self-sharded WebDataset stream (what train scripts do with shards)."
    import sys, torch
    from torch import nn
    from imagegen.data import make_dataloader, make_dataset
    from imagegen.training.loop import TrainConfig, train
    class Tiny:
        def __init__(self):
            torch.manual_seed(0); self.trainable = nn.Linear(3, 3)
        def loss(self, model, batch): return (model(batch['pixel_values'].mean(dim=(2, 3))) ** 2).mean()
    src = make_dataset(sys.argv[1], 32, resampled=False, epoch_size=32, shuffle_buffer=4)
    train(Tiny(), make_dataloader(src, batch_size=4), TrainConfig(output_dir=sys.argv[2], max_steps=8, tracker='none', checkpoint_every=None))
''')


def test_shard_stream_two_ranks(shapes, tmp_path):
    "Shards are split by the dataset itself (each rank reads its own shards): every sample once per epoch, new order each epoch."
    (tmp_path/'shard_train.py').write_text(SHARD_TRAIN)
    launch(tmp_path/'shard_train.py', shapes/'shards'/'train', tmp_path/'run', probe=tmp_path/'probe')
    r0, r1 = rank_records(tmp_path/'probe', 2)
    expected = {f'shapes-L1-train-{i:08d}' for i in range(N_TRAIN)}
    for e in (0, 1):
        assert len(epoch_keys(r0, e)) == len(epoch_keys(r1, e)) == N_TRAIN // 2
        assert_once(epoch_keys(r0, e), epoch_keys(r1, e), expected=expected)
    assert epoch_keys(r0, 0) != epoch_keys(r0, 1) or epoch_keys(r1, 0) != epoch_keys(r1, 1), "set_epoch did not reach the stream"
    torch.testing.assert_close(r0['params'], r1['params'], rtol=0, atol=0)


def rows_and_images(folder):
    rows = [json.loads(l) for l in (Path(folder)/'samples.jsonl').read_text().splitlines()]
    return rows, [np.asarray(Image.open(Path(folder)/r['file_name']).convert('RGB')).astype(int) for r in rows]


def script_main(name):
    "`main` of scripts/<name>.py imported into this process."
    import importlib.util
    spec = importlib.util.spec_from_file_location(f'{name}_script', ROOT/'scripts'/f'{name}.py')
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod.main


def test_sample_two_ranks_matches_one_and_evaluates_all(ldm2, tmp_path, monkeypatch):
    from imagegen.shapes import ShapesDataset, ShapesOracle, prompt
    out, _ = ldm2
    kw = dict(model=out/'model', shapes_split='test', n=5, steps=3, batch_size=2, seed=7)   # 5 prompts: 3 on rank 0, 2 on rank 1
    launch('scripts/sample.py', *(x for k, v in kw.items() for x in (f'--{k}', v)), '--out', tmp_path/'two', probe=tmp_path/'probe')
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)   # the one-process reference runs here, on the CPU like the ranks
    monkeypatch.setenv('ACCELERATE_USE_CPU', '1')
    script_main('sample')(**{k: str(v) if isinstance(v, Path) else v for k, v in kw.items()}, out=str(tmp_path/'one'))
    (rows2, ims2), (rows1, ims1) = rows_and_images(tmp_path/'two'), rows_and_images(tmp_path/'one')
    scenes = [ShapesDataset('test', 1, n=5, seed=7).scene(i) for i in range(5)]
    assert [r['prompt'] for r in rows2] == [prompt(s) for s in scenes], "prompts out of order"
    assert [r['seed'] for r in rows2] == list(range(7, 12)) and rows2 == rows1
    for a, b in zip(ims2, ims1): assert np.abs(a - b).max() <= 1   # same image; batches differ, so float rounding may too
    alone = script_main('sample')(model=str(out/'model'), prompts=rows2[4]['prompt'], seed=11, steps=3, out=str(tmp_path/'alone'))
    assert np.abs(np.asarray(alone[0]).astype(int) - ims2[4]).max() <= 1, "image 4 (made on rank 1) is not prompt 4's image"
    assert not all(np.array_equal(ims2[0], x) for x in ims2[1:]), "images differ per prompt/seed"
    r0, r1 = rank_records(tmp_path/'probe', 2)
    assert r1['writes'] == [], f"rank 1 wrote {r1['writes']}"
    assert {'samples.jsonl', 'grid.png', '000004.png'} <= {Path(p).name for _, p in r0['writes']}
    # evaluation of the gathered folder covers every rank's images; under a launch only rank 0 does it
    evaluate = script_main('evaluate')
    monkeypatch.setenv('RANK', '1')
    assert evaluate(['--samples', str(tmp_path/'two')]) is None and not (tmp_path/'two'/'metrics.json').exists()
    monkeypatch.setenv('RANK', '0')
    evaluate(['--samples', str(tmp_path/'two'), '--feature', 'random'])
    m = json.loads((tmp_path/'two'/'metrics.json').read_text())
    assert m['n_images'] == m['oracle/n'] == 5 and m['n_real'] == m['n_fake'] == 5
    ref = ShapesOracle().report([Image.open(tmp_path/'one'/r['file_name']).convert('RGB') for r in rows1], [r['scene'] for r in rows1])
    assert {k: m[f'oracle/{k}'] for k in ref} == ref


KERNEL_CODE = '''
import json, os, tempfile, torch
from pathlib import Path
from imagegen.diagnostics import diagnose, launch_in_notebook
_ = diagnose()                                # the first cell of a notebook: must leave CUDA alone
x = torch.randn(256, 256); x = x @ x          # the kernel has run torch before launching
def train_fn(out, scale=1.0):                 # defined in the notebook: forked ranks get it without pickling
    from accelerate import Accelerator
    acc = Accelerator()
    total = acc.reduce(torch.tensor([scale * (acc.process_index + 1)], device=acc.device), 'sum').item()
    Path(out, f'rank{acc.process_index}.json').write_text(json.dumps(dict(n=acc.num_processes, total=total, pid=os.getpid(),
                                                                          type=str(acc.distributed_type))))
d = tempfile.mkdtemp()
launch_in_notebook(train_fn, d, scale=2.0)
print('RESULT', json.dumps({'kernel_pid': os.getpid(), 'ranks': [json.loads(p.read_text()) for p in sorted(Path(d).iterdir())]}))
'''


def test_launch_in_notebook_real_kernel():
    "In a real Jupyter kernel, launch_in_notebook runs a notebook-defined function on 2 CPU ranks (one per GPU on a GPU node)."
    from jupyter_client.manager import start_new_kernel
    km, kc = start_new_kernel(kernel_name='python3', cwd=str(ROOT))
    try:
        out = []
        kc.execute_interactive(KERNEL_CODE, timeout=240, output_hook=lambda m: out.append(m['content'].get('text', '') +
                                                                                         ''.join(m['content'].get('traceback', []))))
        text = ''.join(out)
    finally:
        kc.stop_channels(); km.shutdown_kernel(now=True)
    line = next((l for l in text.splitlines() if l.startswith('RESULT ')), None)
    assert line, text[-3000:]
    r = json.loads(line[len('RESULT '):])
    from imagegen.diagnostics import notebook_processes
    n, kind = notebook_processes()   # 2 CPU ranks here; one rank per GPU on a GPU node
    assert [(x['n'], x['total']) for x in r['ranks']] == [(n, n * (n + 1.0))] * n, r
    if n > 1:
        assert {x['type'] for x in r['ranks']} == {f"DistributedType.MULTI_{kind}"}
        assert len({x['pid'] for x in r['ranks']} | {r['kernel_pid']}) == n + 1, "ranks are processes besides the kernel"
