"The Shapes writer CLI as a subprocess: --help, and a tiny run whose output loads through datasets and our loaders."
import json, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_make_shapes_help():
    r = subprocess.run([sys.executable, 'scripts/make_shapes.py', '--help'], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and '--samples_per_shard' in r.stdout and '--format' in r.stdout


def test_make_shapes_writes_both_formats(tmp_path):
    r = subprocess.run([sys.executable, 'scripts/make_shapes.py', '--out', str(tmp_path), '--n_train', '12', '--n_validation', '4',
                        '--n_test', '4', '--samples_per_shard', '5', '--level', '2'], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    info = json.loads((tmp_path/'info.json').read_text())
    assert sorted(p.name for p in (tmp_path/'shards'/'train').glob('*.tar')) == [f'shapes-L2-train-00000{i}.tar' for i in range(3)]
    import datasets
    from imagegen.data import make_dataset
    hf = datasets.load_dataset('imagefolder', data_dir=str(tmp_path/'imagefolder'))
    assert {k: len(v) for k, v in hf.items()} == {'train': 12, 'validation': 4, 'test': 4}
    assert len(list(make_dataset(info['splits']['train']['shards'], 32, resampled=False))) == 12
    r = subprocess.run([sys.executable, 'scripts/make_shapes.py', '--out', str(tmp_path), '--format', 'zip'], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and 'imagefolder, shards or both' in r.stderr and 'Traceback' not in r.stderr
    r = subprocess.run([sys.executable, 'scripts/make_shapes.py', '--out', str(tmp_path), '--n_tr', '3'], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and 'unrecognized arguments: --n_tr' in r.stderr   # no prefix abbreviations
