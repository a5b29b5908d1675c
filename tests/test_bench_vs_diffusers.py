"""`scripts/bench_vs_diffusers.py` as users run it: whole training processes under `accelerate launch`, timed at two
step counts; ours alone here (diffusers' train_text_to_image.py is not in this repository and needs torchvision), both
sides where DIFFUSERS_TRAIN_TEXT_TO_IMAGE names that script; bad flags and a failing run reported, not swallowed."""
import json, os, sys
from pathlib import Path
import pytest
from conftest import run, ROOT

SCRIPT = str(ROOT/'scripts'/'bench_vs_diffusers.py')
TINY = ['--n_images', '8', '--train_batch_size', '2', '--short_steps', '1', '--long_steps', '3', '--resolution', '32', '--width', '32']
ENV = {'OMP_NUM_THREADS': '1'}


@pytest.mark.slow   # the flags and failure paths below stay in the default run
def test_ours_alone_table_and_json(tmp_path):
    out = tmp_path/'bench.json'
    p = run([sys.executable, SCRIPT, '--implementations', 'ours', *TINY, '--warmup_steps', '0', '--work_dir', str(tmp_path/'work'),
             '--json_out', str(out)], env=ENV)
    d = json.loads(out.read_text())
    assert [(r['implementation'], r['cache']) for r in d['rows']] == [('ours', 'on'), ('ours', 'off')]
    assert [(r['implementation'], r['cache'], r['steps']) for r in d['runs']] == [('ours', c, s) for s in (1, 3) for c in ('on', 'off')]
    assert all(r['long_s'] > 0 and r['ratio'] is None for r in d['rows'])                # no diffusers row: no ratio
    assert '--cache_latents' in d['commands']['ours cache on'] and '--cache_latents' not in d['commands']['ours cache off']
    assert '| ours | on | 1 → 3 |' in p.stdout and 'accelerate.commands.launch' in p.stdout
    assert (tmp_path/'work'/'model'/'model_index.json').exists() and not any((tmp_path/'work'/'out').iterdir())   # run outputs removed


def test_bad_flags_and_a_failing_run(tmp_path):
    p = run([sys.executable, SCRIPT, *TINY], check=False, env=ENV)               # diffusers' side asked for, no script given
    assert p.returncode != 0 and '--diffusers_script' in p.stderr and 'Traceback' not in p.stderr, p.stderr
    bad = tmp_path/'train_text_to_image.py'
    bad.write_text("import sys\nprint('loading the model', flush=True)\nsys.exit('boom: no such column in this data')\n")
    p = run([sys.executable, SCRIPT, '--implementations', 'diffusers', '--diffusers_script', str(bad), *TINY,
             '--work_dir', str(tmp_path/'work')], check=False, env=ENV)
    assert p.returncode != 0 and 'a training run failed' in p.stderr and 'boom: no such column' in p.stderr, p.stderr
    assert f'{bad} --pretrained_model_name_or_path' in p.stderr                  # the command that failed is shown
    assert (tmp_path/'work'/'logs'/'diffusers_warmup.err').exists()


@pytest.mark.skipif(not os.environ.get('DIFFUSERS_TRAIN_TEXT_TO_IMAGE'),
                    reason="set DIFFUSERS_TRAIN_TEXT_TO_IMAGE to diffusers' examples/text_to_image/train_text_to_image.py "
                           "(it needs torchvision) to time diffusers' side too")
def test_both_sides(tmp_path):
    out = tmp_path/'bench.json'
    run([sys.executable, SCRIPT, '--diffusers_script', os.environ['DIFFUSERS_TRAIN_TEXT_TO_IMAGE'], *TINY, '--long_steps', '8',
         '--ours_cache', 'on', '--warmup_steps', '1', '--json_out', str(out)], env=ENV)
    rows = json.loads(out.read_text())['rows']
    assert [(r['implementation'], r['cache']) for r in rows] == [('ours', 'on'), ('diffusers', '-')]
    assert rows[1]['ratio'] == 1.0 and all(r['long_s'] > 0 for r in rows)
