"`scripts/sample.py` under what users get wrong: every bad number or file is one line and exit 2, a folder in use is refused, a full disk keeps what was there."
import json, os, shutil, subprocess, sys
from pathlib import Path

import pytest

from conftest import ROOT, run_many


@pytest.fixture(scope='module')
def tiny_ldm(tmp_path_factory):
    "An untrained tiny latent diffusion folder (what `main` loads before it reads prompts)."
    from imagegen.diffusion.ldm import LatentDiffusion, LDMConfig
    d = tmp_path_factory.mktemp('model')/'m'
    LatentDiffusion.from_config(LDMConfig.preset('tiny'), corpus=['a red circle', 'a blue square']).save_pretrained(d)
    return d


def files(tmp):
    "Prompt files a user may hand over by mistake."
    tmp.mkdir(parents=True, exist_ok=True)
    for name, data in (('empty.txt', b''), ('blank.txt', b' \n\t\n'), ('latin1.txt', 'caf\xe9 au lait'.encode('latin-1')),
                       ('binary.bin', bytes(range(256)))):
        (tmp/name).write_bytes(data)
    (tmp/'a_file').write_text('x')
    return tmp


BAD = [   # (flags, what the one line must say)
    (['--guidance', 'nan'], '--guidance nan: must be a finite number'),
    (['--guidance', 'inf'], '--guidance inf: must be a finite number'),
    (['--guidance', '-1'], '--guidance -1.0: must be >= 0'),
    (['--steps', '0'], '--steps 0: must be >= 1'),
    (['--n', '0'], '--n 0: must be >= 1'),
    (['--seed', '-1'], '--seed -1: must be >= 0'),
    (['--batch_size', '0'], '--batch_size 0: must be >= 1'),
    (['--top_k', '0'], '--top_k 0: must be >= 1'),
    (['--top_p', '2'], '--top_p 2.0: must be > 0 and <= 1'),
    (['--temperature', '0'], '--temperature 0.0: must be > 0'),
    (['--eta', 'nan'], '--eta nan: must be a finite number'),
    (['--shapes_level', '3'], '--shapes_level 3: must be >= 1 and <= 2'),
    (['--prompt_file', '{tmp}/empty.txt'], 'holds no prompt'),
    (['--prompt_file', '{tmp}/blank.txt'], 'holds no prompt'),
    (['--prompt_file', '{tmp}/latin1.txt'], 'is not UTF-8 text'),
    (['--prompt_file', '{tmp}/binary.bin'], 'is not UTF-8 text'),
    (['--prompt_file', '{tmp}'], 'is a folder'),
    (['--prompts', ''], 'prompt 1 of 1 is empty'),
    (['--prompts', 'a red circle||a blue square'], 'prompt 2 of 3 is empty'),
    (['--out', '{tmp}/a_file/samples'], 'a_file'),
    (['--top_k', '5', '--shapes_split', 'test', '--n', '2'], 'apply to latent GPT models, not to diffusion'),
]


@pytest.fixture(scope='module')
def bad_runs(tiny_ldm, tmp_path_factory):
    tmp = files(tmp_path_factory.mktemp('files'))
    out = tmp_path_factory.mktemp('out')
    calls = []
    for flags, _ in BAD:
        flags = [f.format(tmp=tmp) for f in flags]
        base = ['--model', tiny_ldm] + ([] if '--out' in flags else ['--out', out/'s']) + \
               ([] if {'--prompt_file', '--prompts', '--shapes_split'} & set(flags) else ['--prompts', 'a red circle'])
        calls.append(('scripts/sample.py', base + flags, {'HF_HUB_OFFLINE': '1'}))
    return dict(zip(range(len(BAD)), run_many(calls)))


@pytest.mark.parametrize('i', range(len(BAD)), ids=[' '.join(f for f in b[0]) or 'empty' for b in BAD])
def test_bad_flags_and_files_are_one_line_and_exit_2(bad_runs, i):
    p, expect = bad_runs[i], BAD[i][1]
    err = p['stderr'].strip().splitlines()
    assert p['returncode'] == 2 and 'Traceback' not in p['stderr'], p['stderr'][-3000:]
    assert err and err[-1].startswith('sample.py: error: ') and expect in err[-1], p['stderr'][-3000:]


def sample(model, out, *flags, check=True):
    p = subprocess.run([sys.executable, 'scripts/sample.py', '--model', str(model), '--out', str(out), '--steps', '1', *map(str, flags)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, 'HF_HUB_OFFLINE': '1'})
    if check: assert p.returncode == 0, p.stderr[-3000:]
    return p


def listing(out):
    rows = [json.loads(l) for l in (Path(out)/'samples.jsonl').read_text().splitlines()]
    return [r['file_name'] for r in rows], sorted(f.name for f in Path(out).glob('[0-9]*.png'))


def test_a_folder_in_use_is_refused_and_a_rerun_describes_its_own_files(tiny_ldm, tmp_path):
    out = tmp_path/'s'
    sample(tiny_ldm, out, '--shapes_split', 'test', '--n', 5)
    # another sampling run holds the folder (this test's own live process stands for it)
    from imagegen.training.checkpoints import acquire_run_lock, release_run_lock
    lock = acquire_run_lock(out)
    try:
        p = sample(tiny_ldm, out, '--shapes_split', 'test', '--n', 3, check=False)
        assert p.returncode == 2 and f'pid {os.getpid()}' in p.stderr.splitlines()[-1], p.stderr[-3000:]
        assert listing(out) == ([f'{i:06d}.png' for i in range(5)],) * 2             # the holder's files untouched
    finally: release_run_lock(lock)
    sample(tiny_ldm, out, '--shapes_split', 'test', '--n', 3)                          # free again: a shorter run replaces the set
    names, present = listing(out)
    assert names == present == [f'{i:06d}.png' for i in range(3)]
    assert not (out/'.lock').exists() and not list(out.glob('.staging-*'))


def test_a_full_disk_is_one_line_and_keeps_the_last_samples(tiny_ldm, tmp_path):
    if os.geteuid() != 0 or not shutil.which('mount'): pytest.skip('needs root to mount a small tmpfs')
    disk = tmp_path/'disk'; disk.mkdir()
    if subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=256k', 'tmpfs', str(disk)], capture_output=True).returncode:
        pytest.skip('cannot mount a tmpfs here')
    try:
        out = disk/'s'
        sample(tiny_ldm, out, '--shapes_split', 'test', '--n', 2)
        before = {f.name: f.read_bytes() for f in out.iterdir()}
        p = sample(tiny_ldm, out, '--shapes_split', 'test', '--n', 400, '--batch_size', 200, check=False)
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode == 2 and 'Traceback' not in p.stderr and 'no space left' in last and ' free)' in last, p.stderr[-3000:]
        assert {f.name: f.read_bytes() for f in out.iterdir()} == before                  # the earlier samples, byte for byte
    finally: subprocess.run(['umount', str(disk)], capture_output=True)
