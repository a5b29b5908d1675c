"Tests of the Shapes benchmark, its oracle, the writers and every offline loader source, sharding and bad data."
import io, json, tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from imagegen.shapes import (HELD_OUT, SPLITS, ShapesDataset, ShapesOracle, Scene, captions, degrade, flip_caption,
                             flip_scene, render)
from imagegen.data import (BadDataError, ImageFolderSource, ShardSource, ImageTransform, make_dataloader, make_dataset,
                           shard_pattern, write_imagefolder, write_shards, CaptionCollator)


@pytest.fixture(scope='module')
def oracle(): return ShapesOracle()


# ---------------------------------------------------------------- Shapes and the held-out split
@pytest.mark.parametrize('level', [1, 2])
def test_held_out_pairs_never_in_train_or_validation(level):
    held = {tuple(p) for p in HELD_OUT}
    for split in ('train', 'validation'):
        ds = ShapesDataset(split, level, n=2000)
        pairs = {(o.color, o.shape) for i in range(len(ds)) for o in ds.scene(i).objects}
        assert not pairs & held
        assert {c for c, _ in pairs} == {c for c, _ in held}          # every colour still occurs in training
    test = ShapesDataset('test', level, n=500)
    for i in range(len(test)): assert any((o.color, o.shape) in held for o in test.scene(i).objects)


def test_splits_are_deterministic_and_distinct():
    a, b = ShapesDataset('train', 2, 32, n=50), ShapesDataset('train', 2, 32, n=50)
    assert all(np.array_equal(np.asarray(a[i]['image']), np.asarray(b[i]['image'])) for i in range(0, 50, 7))
    tr = {json.dumps(ShapesDataset('train', 1, n=300).scene(i).to_dict()) for i in range(300)}
    va = {json.dumps(ShapesDataset('validation', 1, n=300).scene(i).to_dict()) for i in range(300)}
    assert len(tr & va) < 10   # jittered scenes: almost never identical


def test_scene_roundtrip_and_captions():
    ds = ShapesDataset('test', 2, 32, n=20)
    for i in range(20):
        it = ds[i]
        assert Scene.from_dict(it['scene']).to_dict() == it['scene']
        assert len(it['captions']) == 5 and len(set(it['captions'])) == 5
        assert it['captions'] == captions(it['scene'])


def test_flip_swaps_left_and_right():
    ds = ShapesDataset('train', 2, 32, n=40)
    sc = next(ds.scene(i) for i in range(40) if ds.scene(i).relation == 'left of').to_dict()
    f = flip_scene(sc)
    assert f['relation'] == 'right of' and f['objects'][0]['position'] == 'right'
    assert flip_caption('a red circle to the left of a blue square') == 'a red circle to the right of a blue square'
    a, b = np.asarray(render(sc, 64), float), np.asarray(render(f, 64), float)[:, ::-1]
    assert np.abs(a - b).mean() < 2


# ---------------------------------------------------------------- oracle
@pytest.mark.parametrize('split', SPLITS)
@pytest.mark.parametrize('res', [32, 64, 256])
def test_oracle_ground_truth(oracle, split, res):
    for level in (1, 2):
        ds = ShapesDataset(split, level, res, n=100 if res < 256 else 40, seed=3)
        r = oracle.report([it['image'] for it in ds], [it['scene'] for it in ds])
        assert r['overall'] >= 0.99, (split, res, level, r)


@pytest.mark.parametrize('level', [1, 2])
def test_oracle_robust_to_blur_and_colour_shift(oracle, level):
    ds = ShapesDataset('test', level, 32, n=150, seed=5)
    ims = [degrade(it['image'], blur=1.0, shift=25, noise=6, seed=i) for i, it in enumerate(ds)]
    r = oracle.report(ims, [it['scene'] for it in ds])
    assert r['color'] >= 0.97 and r['color_and_shape'] >= 0.93 and r['overall'] >= 0.9, r
    ims64 = [degrade(ShapesDataset('test', level, 64, n=60, seed=5)[i]['image'], blur=0.7, shift=20, seed=i) for i in range(60)]
    assert oracle.report(ims64, [ds[i]['scene'] for i in range(60)])['overall'] >= 0.95


def test_oracle_chance_on_noise_and_wrong_captions(oracle):
    ds = ShapesDataset('validation', 1, 32, n=200)
    scenes = [it['scene'] for it in ds]
    rng = np.random.default_rng(0)
    noise = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(50)]
    assert oracle.report(noise, scenes[:50])['color_and_shape'] <= 0.1
    smooth = [Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize((32, 32), Image.BICUBIC) for _ in range(50)]
    assert oracle.report(smooth, scenes[:50])['overall'] <= 0.1
    wrong = oracle.report([it['image'] for it in ds], scenes[7:] + scenes[:7])
    # chance: colour 1/6, colour and shape ~ 1/18 among training pairs
    assert wrong['color'] < 0.3 and wrong['color_and_shape'] < 0.15 and wrong['overall'] < 0.05, wrong


def test_oracle_accepts_tensors(oracle):
    it = ShapesDataset('test', 1, 32, n=1)[0]
    x = torch.from_numpy(np.array(it['image'])).permute(2, 0, 1).float() / 127.5 - 1
    assert oracle.score(x, it['scene'])['all']


# ---------------------------------------------------------------- writers and sources
@pytest.fixture(scope='module')
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp('shapes')
    ds = ShapesDataset('train', 1, 64, n=40)
    write_imagefolder(ds, d/'folder'/'train')
    paths = write_shards(ds, d/'shards', samples_per_shard=10)
    return d, ds, paths


def test_imagefolder_loads_with_datasets(written):
    import datasets
    d, ds, _ = written
    hf = datasets.load_dataset('imagefolder', data_dir=str(d/'folder'), split='train')
    assert len(hf) == 40 and hf[3]['text'] == ds[3]['captions'][0] and hf[3]['captions'] == ds[3]['captions']
    assert np.array_equal(np.asarray(hf[3]['image'].convert('RGB')), np.asarray(ds[3]['image']))


def test_hf_imagefolder_source(written):
    d, ds, _ = written
    src = make_dataset('hf:imagefolder', 32, 'train', data_dir=d/'folder')
    s = src[5]
    assert s['pixel_values'].shape == (3, 32, 32) and s['captions'] == ds[5]['captions']


def test_hf_name_plumbing(monkeypatch, tmp_path):
    import datasets
    calls = []
    rows = {'image': [Image.new('RGB', (20, 20), c) for c in ('red', 'blue', 'green')],
            'caption': [['a'] * 5, ['b'] * 5, ['c'] * 5], 'split': ['train', 'val', 'test']}
    def fake(name, **kw):
        calls.append((name, kw))
        return datasets.DatasetDict({'test': datasets.Dataset.from_dict(rows).cast_column('image', datasets.Image())})
    monkeypatch.setattr(datasets, 'load_dataset', fake)
    src = make_dataset('nlphuji/flickr30k', 16, 'validation', cache_dir=str(tmp_path))
    assert calls == [('nlphuji/flickr30k', {'cache_dir': str(tmp_path)})]
    assert len(src) == 1 and src[0]['captions'] == ['b'] * 5


def test_imagefolder_source_and_loader(written):
    d, ds, _ = written
    dl = make_dataloader(str(d/'folder'), batch_size=8, resolution=32, split='train', caption_dropout=0.)
    b = next(iter(dl))
    assert b['pixel_values'].shape == (8, 3, 32, 32) and b['pixel_values'].dtype == torch.float32
    assert b['pixel_values'].min() >= -1 and b['pixel_values'].max() <= 1
    assert all(c in captions(s) for c, s in zip(b['caption'], b['scene']))
    assert len(dl) == 5 and dl.self_sharded is False


def test_shards_roundtrip(written):
    d, ds, paths = written
    src = make_dataset(shard_pattern(paths), 64, resampled=False, shuffle_buffer=0)
    got = {s['key']: s for s in src}
    assert len(got) == 40
    s = got['shapes-00000007']
    assert s['captions'] == ds[7]['captions'] and s['scene'] == ds[7]['scene']
    assert torch.equal(s['pixel_values'], torch.from_numpy(np.asarray(ds[7]['image']).copy()).permute(2, 0, 1).float() / 127.5 - 1)


def _keys(src):
    return [s['key'] for s in src]


def test_shards_epoch_covers_data_once_over_ranks_and_workers(written):
    d, _, paths = written
    seen = []
    for rank in range(2):
        src = make_dataset(str(d/'shards'), 32, resampled=False, rank=rank, world_size=2, shuffle_buffer=4)
        dl = make_dataloader(src, batch_size=3, num_workers=2)
        seen.append([k for b in dl for k in b['key']])
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(f'shapes-{i:08d}' for i in range(40))
    # fewer shards than readers: sample-level split, still exactly once
    one = [_keys(make_dataset(str(paths[0]), 32, resampled=False, rank=r, world_size=3, shuffle_buffer=0)) for r in range(3)]
    assert sorted(sum(one, [])) == sorted(f'shapes-{i:08d}' for i in range(10)) and all(one)


def test_resampled_epochs_and_step_bookkeeping(written):
    d, _, _ = written
    lens, firsts = [], []
    for rank in range(2):
        src = make_dataset(str(d/'shards'), 32, epoch_size=64, rank=rank, world_size=2, shuffle_buffer=8)
        dl = make_dataloader(src, batch_size=4, num_workers=2)
        assert len(dl) == 8 and dl.self_sharded
        ep0 = [b['key'] for b in dl]
        assert len(ep0) == 8 and all(len(k) == 4 for k in ep0)
        src.set_epoch(1)
        ep1 = [b['key'] for b in dl]
        assert len(ep1) == 8 and ep1 != ep0
        firsts.append(ep0)
    assert firsts[0] != firsts[1]          # ranks read different streams
    # the infinite stream goes on past the number of samples in the data
    src = make_dataset(str(d/'shards'), 32, epoch_size=200, rank=0, world_size=1)
    assert len(_keys(src)) == 200
    # without epoch_size: one pass of the shards (as --epoch_size's help says), counted from the tar headers
    one_pass = make_dataset(str(d/'shards'), 32)
    assert one_pass.epoch_size == len(_keys(make_dataset(str(d/'shards'), 32, resampled=False))) > 0


def test_workers_get_different_samples_map_style():
    dl = make_dataloader('shapes:n=32', batch_size=4, num_workers=2, shuffle=False)
    keys = [k for b in dl for k in b['key']]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 32


def _prepare_fn(out_dir):
    import os
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    dl = acc.prepare(make_dataloader('shapes:n=32', batch_size=4, shuffle=True))
    keys = [k for b in dl for k in b['key']]
    src = make_dataset(os.environ['SHARDS'], 32, resampled=False, shuffle_buffer=0)
    shard_keys = [s['key'] for s in src]
    Path(out_dir, f'rank{acc.process_index}.json').write_text(json.dumps({'map': keys, 'shards': shard_keys}))


def test_two_ranks_with_accelerate(written, tmp_path, monkeypatch):
    from accelerate import debug_launcher
    import functools
    d, _, _ = written
    monkeypatch.setenv('SHARDS', str(d/'shards'))
    debug_launcher(functools.partial(_prepare_fn, str(tmp_path)), num_processes=2)
    r = [json.loads((tmp_path/f'rank{i}.json').read_text()) for i in range(2)]
    assert len(r[0]['map']) == len(r[1]['map']) == 16 and not set(r[0]['map']) & set(r[1]['map'])
    assert not set(r[0]['shards']) & set(r[1]['shards']) and len(r[0]['shards']) + len(r[1]['shards']) == 40


def test_cfg_dropout_rate():
    torch.manual_seed(0)
    s = make_dataset('shapes:n=1', 32)[0]
    for p in (0.0, 0.1, 0.5, 1.0):
        b = CaptionCollator(p)([s] * 5000)
        assert abs(np.mean([c == '' for c in b['caption']]) - p) < 0.025
    dl = make_dataloader('shapes:n=2000', batch_size=100, caption_dropout=0.2, num_workers=2)
    rate = np.mean([c == '' for b in dl for c in b['caption']])
    assert abs(rate - 0.2) < 0.03


def test_random_flip_keeps_captions_true(oracle):
    src = make_dataset('shapes', 32, 'validation', n=60, flip_p=0.5)
    ok = []
    for i in range(60):
        s = src[i]
        img = Image.fromarray(((s['pixel_values'].permute(1, 2, 0).numpy() + 1) * 127.5).round().astype(np.uint8))
        ok.append(oracle.score(img, s['scene'])['all'] and s['captions'] == captions(s['scene']))
    assert all(ok)


def _cache_fn(out_dir, cache_dir):
    "One rank: encode Shapes into the shared on-disk cache, recording how many images this rank encoded."
    from accelerate import Accelerator
    from imagegen.data import encode_dataset_cached
    acc = Accelerator(cpu=True)
    seen = []
    def enc(x): seen.append(len(x)); return {'mean': x.mean(dim=(2, 3)), 'ids': (x[:, 0, :2, :2] > 0).long()}
    ds = encode_dataset_cached(enc, make_dataset('shapes:n=21', 32), cache_dir, {'data': 'shapes:n=21'}, accelerator=acc,
                               batch_size=4, progress=False, desc='latents')
    Path(out_dir, f'rank{acc.process_index}.json').write_text(json.dumps(
        {'encoded': sum(seen), 'path': str(ds.path), 'keys': ds.keys, 'mean': [ds[i]['mean'].tolist() for i in range(len(ds))]}))


def test_on_disk_cache_split_across_two_ranks(tmp_path):
    "Each rank encodes its own share once; both read the whole sealed folder, equal to one process's encoding."
    from accelerate import debug_launcher
    import functools
    from imagegen.data import encode_dataset
    debug_launcher(functools.partial(_cache_fn, str(tmp_path), str(tmp_path/'cache')), num_processes=2)
    r = [json.loads((tmp_path/f'rank{i}.json').read_text()) for i in range(2)]
    assert [x['encoded'] for x in r] == [10, 11]                      # 21 samples: 10 + 11, nobody encodes everything
    assert r[0]['path'] == r[1]['path'] and r[0]['keys'] == r[1]['keys'] and r[0]['mean'] == r[1]['mean']
    one = encode_dataset(lambda x: {'mean': x.mean(dim=(2, 3))}, make_dataset('shapes:n=21', 32), batch_size=4, progress=False)
    assert r[0]['keys'] == one.keys and np.allclose(r[0]['mean'], one.tensors['mean'].numpy(), atol=1e-6)
    assert [p.name for p in (tmp_path/'cache').iterdir()] == [Path(r[0]['path']).name]   # sealed: no *.partial left
    debug_launcher(functools.partial(_cache_fn, str(tmp_path), str(tmp_path/'cache')), num_processes=2)
    assert [json.loads((tmp_path/f'rank{i}.json').read_text())['encoded'] for i in range(2)] == [0, 0]   # a rerun reads it
