"""`scripts/benchmark.py` as users run it: one table across the families, the JSON rows, a bad family refused."""
import json, sys
import pytest
from conftest import run, ROOT


def bench(tmp_path, families:str, presets:str):
    out = tmp_path/'bench.json'
    p = run([sys.executable, str(ROOT/'scripts'/'benchmark.py'), '--families', families, '--presets', presets, '--batch', '2',
             '--steps', '1', '--warmup', '1', '--sample_steps', '2', '--sample_batch', '1', '--json_out', str(out)])
    return p, json.loads(out.read_text())['rows']


def test_benchmark_table_and_json(tmp_path):
    p, rows = bench(tmp_path, 'ldm,glide', 'tiny')
    assert [(r['family'], r['preset']) for r in rows] == [('ldm', 'tiny'), ('glide', 'tiny')]
    for r in rows:
        assert r['train_images_s'] > 0 and r['sample_images_s'] > 0 and r['gflops_per_image'] > 0
        assert r['mfu'] is None and r['peak_mem_gib'] is None          # a CPU: no peak to compare with, no CUDA memory
    assert '| ldm | tiny |' in p.stdout and 'FlopCounterMode' in p.stdout
    bad = run([sys.executable, str(ROOT/'scripts'/'benchmark.py'), '--families', 'ldm,dalle'], check=False)
    assert bad.returncode != 0 and "unknown ['dalle']" in bad.stderr and 'Traceback' not in bad.stderr


@pytest.mark.slow   # the table above stays in the default run; this adds a larger preset (most of the time)
def test_benchmark_counts_a_larger_preset(tmp_path):
    p, rows = bench(tmp_path, 'ldm,glide', 'tiny,small')
    # ldm runs tiny and small, glide only the tiny preset it can build offline
    assert [(r['family'], r['preset']) for r in rows] == [('ldm', 'tiny'), ('ldm', 'small'), ('glide', 'tiny')]
    small, tiny = rows[1], rows[0]
    assert small['gflops_per_image'] > 5 * tiny['gflops_per_image'] and small['params_m'] > 5 * tiny['params_m']
    assert '| ldm | small |' in p.stdout
