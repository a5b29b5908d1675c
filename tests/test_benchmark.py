"""`scripts/benchmark.py` as users run it: one table across the families, the JSON rows, a bad family refused."""
import json, sys
from conftest import run, ROOT


def test_benchmark_table_and_json(tmp_path):
    out = tmp_path/'bench.json'
    p = run([sys.executable, str(ROOT/'scripts'/'benchmark.py'), '--families', 'ldm,glide', '--presets', 'tiny,small', '--batch', '2',
             '--steps', '1', '--warmup', '1', '--sample_steps', '2', '--sample_batch', '1', '--json_out', str(out)])
    rows = json.loads(out.read_text())['rows']
    # ldm runs tiny and small, glide only the tiny preset it can build offline
    assert [(r['family'], r['preset']) for r in rows] == [('ldm', 'tiny'), ('ldm', 'small'), ('glide', 'tiny')]
    for r in rows:
        assert r['train_images_s'] > 0 and r['sample_images_s'] > 0 and r['gflops_per_image'] > 0
        assert r['mfu'] is None and r['peak_mem_gib'] is None          # a CPU: no peak to compare with, no CUDA memory
    small, tiny = rows[1], rows[0]
    assert small['gflops_per_image'] > 5 * tiny['gflops_per_image'] and small['params_m'] > 5 * tiny['params_m']
    assert '| ldm | small |' in p.stdout and 'FlopCounterMode' in p.stdout
    bad = run([sys.executable, str(ROOT/'scripts'/'benchmark.py'), '--families', 'ldm,dalle'], check=False)
    assert bad.returncode != 0 and "unknown ['dalle']" in bad.stderr and 'Traceback' not in bad.stderr
