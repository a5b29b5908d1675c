"Every number flag of every script, read from its own `--help`, given NaN: one line naming the flag, exit 2, nothing run (the table is generated, so a new flag is covered the day it appears)."
import re

import pytest

from conftest import ROOT, run_many

SCRIPTS = sorted(p.name for p in (ROOT/'scripts').glob('*.py'))
DEFAULT = re.compile(r'\(default:\s*(-?[0-9][0-9_.e+-]*)\)')


def number_flags(help_text:str) -> list[str]:
    "The long option of every flag whose help shows a numeric default (an int or a float, not a boolean)."
    flags, block = [], []
    def close():
        if not block: return
        text = ' '.join(block)
        opts = re.findall(r'(--[A-Za-z0-9_.-]+)', block[0])
        m = DEFAULT.search(text)
        if opts and m and opts[0] not in ('--help',):
            try: float(m.group(1).replace('_', '')); flags.append(max(opts, key=lambda o: '.' not in o and len(o)))  # the short spelling users type
            except ValueError: pass
    for line in help_text.splitlines():
        if re.match(r'^\s{2}-', line): close(); block = [line]
        elif block and line.startswith(' ' * 10): block.append(line.strip())
        else: close(); block = []
    close()
    return sorted(set(flags))


@pytest.fixture(scope='module')
def helps():
    return dict(zip(SCRIPTS, run_many([(f'scripts/{s}', ['--help'], {'HF_HUB_OFFLINE': '1'}) for s in SCRIPTS])))


def test_every_script_has_help_and_number_flags(helps):
    for s, p in helps.items(): assert p['returncode'] == 0 and 'usage:' in p['stdout'], (s, p['stderr'][-2000:])
    assert len(number_flags(helps['train_ldm.py']['stdout'])) > 20 and '--learning_rate' in number_flags(helps['train_ldm.py']['stdout'])
    assert {'--n', '--seed', '--batch_size'} <= set(number_flags(helps['sample.py']['stdout']))


@pytest.fixture(scope='module')
def nan_runs(helps, tmp_path_factory):
    cases = [(s, f) for s in SCRIPTS for f in number_flags(helps[s]['stdout'])]
    out = tmp_path_factory.mktemp('nan')
    calls = [(f'scripts/{s}', [f, 'nan', *required(helps[s]['stdout'], out/f'{i}')], {'HF_HUB_OFFLINE': '1'}) for i, (s, f) in enumerate(cases)]
    return cases, run_many(calls, timeout=1200)


def required(help_text:str, out) -> list[str]:
    "Values for the flags a script requires (from its usage line), so that the NaN, not a missing flag, is what is refused."
    usage = ' '.join(l.strip() for l in help_text.split('\n\n')[0].splitlines())
    req = [m for m in re.findall(r'(?<!\[)(--[A-Za-z0-9_.-]+) [A-Z_]+(?![^\[]*\])', usage)]
    return [x for r in req for x in (r, str(out))]


def test_nan_is_refused_by_name(nan_runs):
    cases, results = nan_runs
    bad = []
    for (script, flag), p in zip(cases, results):
        lines = p['stderr'].strip().splitlines()
        name = flag.lstrip('-').split('.')[-1]
        ok = p['returncode'] == 2 and 'Traceback' not in p['stderr'] and lines and lines[-1].startswith(f'{script}: error: ') and \
             re.search(rf'\b{re.escape(name)}\b|{re.escape(flag)}', lines[-1])
        if not ok: bad.append(f"{script} {flag} nan -> exit {p['returncode']}: {(lines or ['(nothing on stderr)'])[-1][:200]}")
    assert not bad, f"{len(bad)} of {len(cases)} number flags take NaN without one line naming them:\n" + '\n'.join(bad)
