"The notebook-first contract: modules import, scripts are thin CLIs with the future import first, export stays in sync."
import ast, importlib, json, shutil, sys
from pathlib import Path
import pytest
from conftest import ROOT, BIN, run, run_many

MODULES = sorted(p.stem for p in (ROOT/'imagegen').glob('*.py') if not p.stem.startswith('_'))
SCRIPTS = sorted((ROOT/'scripts').glob('*.py'))

@pytest.mark.parametrize('mod', MODULES)
def test_module_imports(mod):
    importlib.import_module(f'imagegen.{mod}')

def test_every_notebook_has_its_module():
    from imagegen.export import library_modules
    mods = library_modules(ROOT)
    assert mods and all((ROOT/'imagegen'/m).exists() for m in mods), mods
    assert {p.stem for p in (ROOT/'nbs'/'scripts').glob('*.ipynb')} and SCRIPTS

@pytest.mark.parametrize('script', SCRIPTS, ids=lambda p: p.name)
def test_script_first_statement_is_future_import(script):
    body = ast.parse(script.read_text()).body
    assert isinstance(body[0], ast.ImportFrom) and body[0].module == '__future__', f"{script.name}: first statement must be `from __future__ import annotations`"
    compile(script.read_text(), str(script), 'exec')

@pytest.fixture(scope='module')
def helps():
    "Every script's `--help`, run as `__main__` in one interpreter (see conftest.run_many)."
    return dict(zip(SCRIPTS, run_many([(s, ['--help']) for s in SCRIPTS])))

@pytest.mark.parametrize('script', SCRIPTS, ids=lambda p: p.name)
def test_script_help(script, helps):
    p = helps[script]
    assert p['returncode'] == 0 and p['stdout'].startswith('usage:'), p

def test_one_script_help_in_its_own_process():
    "The same check as a user types it, once: a fresh interpreter, the script's path, --help."
    p = run([sys.executable, str(ROOT/'scripts'/'train_ldm.py'), '--help'])
    assert p.stdout.startswith('usage: train_ldm.py') and '--learning_rate' in p.stdout, p.stdout
    assert 'less memory, ~30% slower (default: False)' in ' '.join(p.stdout.split()) and 'option_strings' not in p.stdout, p.stdout   # a '%' in a field's help

def test_diagnose_json():
    r = json.loads(run([str(BIN/'imagegen-diagnose'), '--json']).stdout)
    for k in ('versions', 'gpus', 'accelerate', 'notebook', 'slurm', 'storage', 'warnings'): assert k in r
    assert r['notebook'] is False and r['versions']['torch']

def test_diagnose_slurm_env():
    r = json.loads(run([str(BIN/'imagegen-diagnose'), '--json'], env={'SLURM_JOB_ID': '99', 'SLURM_GPUS_ON_NODE': '4',
                                                                      'SLURM_JOB_NODELIST': 'n1'}).stdout)
    assert r['slurm']['job_id'] == '99' and r['slurm']['gpus_per_node'] == 4

def test_distributed_check_two_ranks(tmp_path):
    out = tmp_path/'dist.json'
    p = run([str(BIN/'accelerate'), 'launch', '--multi_gpu', '--num_processes', '2', '--main_process_port', '29517',
             str(ROOT/'scripts'/'diagnose_distributed.py'), '--json_out', str(out)], env={'ACCELERATE_USE_CPU': '1'})
    r = json.loads(out.read_text())
    assert r['num_processes'] == 2 and sorted(x['rank'] for x in r['ranks']) == [0, 1]
    assert len({x['pid'] for x in r['ranks']}) == 2 and r['all_reduce'] == 3.0 and r['ok']
    assert 'distributed check OK: 2 process(es)' in p.stdout

def test_notebook_warning_in_real_kernel():
    "In a real Jupyter kernel, diagnose() warns that a notebook uses one GPU and prints the launch command."
    from jupyter_client.manager import start_new_kernel
    km, kc = start_new_kernel(kernel_name='python3', cwd=str(ROOT))
    try:
        out = []
        kc.execute_interactive("from imagegen.diagnostics import diagnose; _ = diagnose()", timeout=120,
                               output_hook=lambda m: out.append(m['content'].get('text', '')))
        text = ''.join(out)
        assert 'notebook           yes' in text and 'WARNING: This is a notebook: one process' in text, text
        assert 'accelerate launch --num_processes' in text
    finally:
        kc.stop_channels(); km.shutdown_kernel(now=True)

def _copy_repo(dst: Path) -> Path:
    for f in ('nbs', 'imagegen', 'scripts'): shutil.copytree(ROOT/f, dst/f, ignore=shutil.ignore_patterns('__pycache__', '.ipynb_checkpoints'))
    shutil.copy(ROOT/'settings.ini', dst)
    return dst

def test_check_passes_on_repo():
    p = run([str(BIN/'imagegen-export'), '--check'])
    assert 'in sync' in p.stdout

def test_edited_notebook_without_export_fails(tmp_path):
    r = _copy_repo(tmp_path)
    nbp = r/'nbs'/'98_diagnostics.ipynb'
    nb = json.loads(nbp.read_text())
    cell = next(c for c in nb['cells'] if c['cell_type'] == 'code' and ''.join(c['source']).startswith('#| export\ndef gpu_info'))
    cell['source'] = ''.join(cell['source']).replace('One dict per visible GPU', 'Edited docstring')
    nbp.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + '\n')
    p = run([str(BIN/'imagegen-export'), '--check'], cwd=r, check=False)
    assert p.returncode == 1
    assert 'imagegen/diagnostics.py is out of sync' in p.stderr and 'run `make export`' in p.stderr, p.stderr
    run([str(BIN/'imagegen-export')], cwd=r)
    assert 'Edited docstring' in (r/'imagegen'/'diagnostics.py').read_text()
    assert run([str(BIN/'imagegen-export'), '--check'], cwd=r).returncode == 0

def test_unclean_notebook_fails(tmp_path):
    r = _copy_repo(tmp_path)
    nbp = r/'nbs'/'98_diagnostics.ipynb'
    nb = json.loads(nbp.read_text())
    nb['cells'][2]['execution_count'] = 7
    nb['metadata']['widgets'] = None; nb['metadata']['language_info'] = {'name': 'python'}
    nbp.write_text(json.dumps(nb, indent=1) + '\n')
    p = run([str(BIN/'imagegen-export'), '--check'], cwd=r, check=False)
    assert p.returncode == 1 and 'nbs/98_diagnostics.ipynb is not clean' in p.stderr, p.stderr

def test_export_removes_stale_files(tmp_path):
    r = _copy_repo(tmp_path)
    (r/'nbs'/'scripts'/'10_diagnose_distributed.ipynb').rename(r/'nbs'/'scripts'/'10_check_ranks.ipynb')
    shutil.copy(r/'nbs'/'98_diagnostics.ipynb', r/'nbs'/'98_tmp.ipynb')
    nb = json.loads((r/'nbs'/'98_tmp.ipynb').read_text())
    for c in nb['cells']:
        c['source'] = ''.join(c['source']).replace('#| default_exp diagnostics', '#| default_exp tmpmod')
    (r/'nbs'/'98_tmp.ipynb').write_text(json.dumps(nb, indent=1, ensure_ascii=False) + '\n')
    run([str(BIN/'imagegen-export')], cwd=r)
    assert (r/'imagegen'/'tmpmod.py').exists() and (r/'scripts'/'check_ranks.py').exists()
    assert not (r/'scripts'/'diagnose_distributed.py').exists()
    (r/'nbs'/'98_tmp.ipynb').unlink()
    p = run([str(BIN/'imagegen-export')], cwd=r)
    assert not (r/'imagegen'/'tmpmod.py').exists() and 'removed stale imagegen/tmpmod.py' in p.stdout
    (r/'imagegen'/'handwritten.py').write_text('x = 1\n')  # not generated: never deleted
    run([str(BIN/'imagegen-export')], cwd=r)
    assert (r/'imagegen'/'handwritten.py').exists()
