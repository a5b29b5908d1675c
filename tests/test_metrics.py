"Metrics: FID/KID with the offline feature extractor, CLIP score with a tiny local CLIP, the combined report, rank sync."
from conftest import two_ranks
import subprocess, sys
from pathlib import Path
import json
import pytest, torch
from imagegen.metrics import (RandomConvFeatures, clip_score, evaluate_images, fid_kid, image_features, tiny_clip,
                              write_metrics_json)

@pytest.fixture(scope='module')
def sets():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(12, 3, 32, 32, generator=g)
    return a, torch.rand(12, 3, 32, 32, generator=g) * 0.4 + 0.6

def test_fid_self_zero_and_different_positive(sets):
    a, b = sets
    same, diff = fid_kid(a, a, feature='random'), fid_kid(a, b, feature='random')
    assert abs(same['fid']) < 1e-4
    assert diff['fid'] > 1.0
    assert diff['kid_mean'] > same['kid_mean'] and torch.isfinite(torch.tensor(diff['kid_std']))
    assert same['kid_subset_size'] == 12

def test_feature_extractor_named(sets):
    r = fid_kid(*sets, feature='random')
    assert r['fid_features'].startswith('random-conv-seed0-256d') and 'NOT Inception' in r['fid_features']
    _, name = image_features('auto')
    import importlib.util
    assert ('inception' in name) == (importlib.util.find_spec('torch_fidelity') is not None)

def test_features_fixed_across_instances():
    x = torch.rand(2, 3, 16, 16)
    assert torch.equal(RandomConvFeatures(seed=0)(x), RandomConvFeatures(seed=0)(x))
    assert not torch.equal(RandomConvFeatures(seed=0)(x), RandomConvFeatures(seed=1)(x))

def test_pil_input_matches_tensor(sets):
    from imagegen.grids import to_pil
    a, b = sets
    a8, b8 = (a * 255).round() / 255, (b * 255).round() / 255
    r1, r2 = fid_kid(a8, b8, feature='random'), fid_kid(to_pil(a8), to_pil(b8), feature='random')
    assert abs(r1['fid'] - r2['fid']) < 1e-3 * r1['fid']

def test_clip_score_tiny_local_clip():
    s = clip_score(torch.rand(3, 3, 32, 32), ['a red circle', 'a blue square', 'dots'], tiny_clip())
    assert isinstance(s, float) and 0 <= s <= 100

def test_evaluate_and_json(sets, tmp_path):
    class Oracle:
        def report(self, images, scenes): return {'count_acc': torch.tensor(0.5), 'n': len(scenes)}
    a, b = sets
    m = evaluate_images(a[:4], ['x'] * 4, scenes=[{}] * 4, real_images=b[:4], clip=tiny_clip(), oracle=Oracle(), feature='random')
    assert {'fid', 'kid_mean', 'clip_score', 'fid_features', 'oracle/count_acc', 'oracle/n'} <= set(m)
    d = json.loads(write_metrics_json(tmp_path/'m.json', m).read_text())
    assert d['oracle/count_acc'] == 0.5 and d['n_images'] == 4
    assert set(evaluate_images(a[:2], ['x', 'y'], oracle=Oracle())) == {'n_images'}  # no scenes: no oracle

def _two_ranks(worker:str, out): two_ranks(__file__, worker, out)

def _fid_rank_worker(out):
    "Each of 2 ranks updates with its half; torchmetrics all-reduces the states in compute()."
    from accelerate import Accelerator
    from torchmetrics.image.fid import FrechetInceptionDistance
    acc = Accelerator(cpu=True)
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(12, 3, 32, 32, generator=g), torch.rand(12, 3, 32, 32, generator=g) * 0.4 + 0.6
    fid = FrechetInceptionDistance(feature=RandomConvFeatures(), normalize=True)
    sl = slice(acc.process_index * 6, acc.process_index * 6 + 6)
    fid.update(a[sl], real=True); fid.update(b[sl], real=False)
    v = float(fid.compute())
    if acc.is_main_process: torch.save(v, out)

def test_fid_syncs_across_ranks(sets, tmp_path):
    _two_ranks('_fid_rank_worker', tmp_path/'v.pt')
    assert abs(torch.load(tmp_path/'v.pt') - fid_kid(*sets, feature='random')['fid']) < 1e-3
