"""Every number flag of every script, read from the script's own argument parser, given bad values (NaN, infinity, a
fraction for a count, a negative number), and every flag that reads a file or folder given a missing path: one line
naming the flag (or the path), exit 2, nothing run. The table is generated from the parsers, so a
flag is covered the day it appears; a case that starts real work is stopped after a time limit and fails by name."""
import json, re, sys, threading

import pytest

from conftest import ROOT, run, run_many

SCRIPTS = sorted(p.name for p in (ROOT/'scripts').glob('*.py'))
DEFAULT = re.compile(r'\(default:\s*(-?[0-9][0-9_.e+-]*)\)\s*$')
ENV = {'HF_HUB_OFFLINE': '1', 'TRANSFORMERS_OFFLINE': '1'}

# Scripts whose flags depend on a leading flag: each variant is read and tested.
VARIANTS = {'train_glide.py': [(), ('--stage', 'upsample')]}
# Int flags where a negative number means something (so -1 is not a bad value for them).
NEGATIVE_OK = {'--step'}

_INTROSPECT = r'''
import argparse, json, runpy, sys
class Parsed(BaseException): pass
def grab(self, args=None, namespace=None):
    raise Parsed([dict(options=a.option_strings, dest=a.dest, type=getattr(a.type, '__name__', None), nargs=a.nargs,
                       default=a.default if isinstance(a.default, (int, float, str, type(None))) else None,
                       help=a.help if isinstance(a.help, str) else None, required=a.required,
                       choices=list(map(str, a.choices)) if a.choices else None) for a in self._actions])
original = argparse.ArgumentParser.parse_known_args
def parse_known_args(self, args=None, namespace=None):
    if not self.add_help: return original(self, args, namespace)   # a pre-parser that takes one flag out (train_glide.py --stage)
    grab(self)
argparse.ArgumentParser.parse_known_args = parse_known_args
out = []
for script, prefix in json.loads(sys.argv[1]):
    sys.argv = [script, *prefix]
    try: runpy.run_path(script, run_name='__main__'); out.append('no parser')
    except Parsed as p: out.append(p.args[0])
    except BaseException as e: out.append(f'{type(e).__name__}: {e}')
print('PARSERS ' + json.dumps(out))
'''


def parsers() -> dict[tuple[str, tuple], list[dict]]:
    "Each (script, leading flags)'s parser actions, taken at the moment it parses (argparse is stopped there, so nothing runs)."
    keys = [(s, p) for s in SCRIPTS for p in VARIANTS.get(s, [()])]
    p = run([sys.executable, '-c', _INTROSPECT, json.dumps([(str(ROOT/'scripts'/s), list(p)) for s, p in keys])], env=ENV, timeout=600)
    got = json.loads(next(l for l in p.stdout.splitlines() if l.startswith('PARSERS '))[len('PARSERS '):])
    return dict(zip(keys, got))


def kind(a:dict) -> str|None:
    "'int' or 'float' for a flag that takes one number, else None: argparse's type, or for the config flags (checked by the config's own coercion) the number their help gives as default."
    if a['nargs'] not in (None,) or a['choices'] or not a['options'] or a['options'][0] in ('-h', '--help'): return None
    if a['type'] in ('int', 'float'): return a['type']
    if a['type'] is None and a['help'] and a['help'] != '==SUPPRESS==' and (m := DEFAULT.search(a['help'])):
        try: int(m.group(1)); return 'int'
        except ValueError:
            try: float(m.group(1)); return 'float'
            except ValueError: return None
    return None


def typed(a:dict) -> str:
    "The spelling users type: the plain `--name` over `--section.name`."
    return min(a['options'], key=lambda o: ('.' in o, -len(o)))


def required_args(actions:list[dict], out) -> list[str]:
    "Values for the flags a script requires, so that the bad number, not a missing flag, is what is refused."
    return [x for a in actions if a['required'] and a['options'] for x in (typed(a), str(out))]


OUTPUTS = re.compile(r'^(out|output|output_dir)$')


def output_args(actions:list[dict], out, tested:str) -> list[str]:
    "Each case's own output folder: a case that did write would write there, not into the default under runs/ that a user's run or the other half of the table may hold (and lock)."
    return [x for a in actions if a['options'] and a['nargs'] is None and not a['required'] and OUTPUTS.match(a['dest'].split('.')[-1])
            and tested not in a['options'] for x in (typed(a), str(out))]


PATH_HELP = re.compile(r'\b(file|folder|directory)\b', re.I)
WRITES = re.compile(r'^(out|output|output_dir|json_out|work_dir|root|encoded_cache|logging_dir|cache_dir|tracking_uri)$')
MISSING = './no_such_dir/nothing_here'
OTHER_FIRST = re.compile(r'is not set|not found|does not exist|not there \(no such file or folder\)|is needed|convert with')


def reads_path(a:dict) -> bool:
    "A flag that reads a file or folder: its help says so, it takes one string, and it is not where the script writes."
    return bool(a['options'] and a['type'] in ('str', None) and a['nargs'] is None and not a['choices'] and a['help']
                and a['help'] != '==SUPPRESS==' and PATH_HELP.search(a['help']) and not WRITES.match(a['dest'].split('.')[-1]))


def bad_values(k:str, flag:str) -> list[str]:
    vals = ['nan', 'inf'] if k == 'float' else ['2.5']
    if k == 'int' and flag not in NEGATIVE_OK: vals.append('-1')
    return vals


@pytest.fixture(scope='module')
def table(tmp_path_factory):
    ps = parsers()
    for key, acts in ps.items(): assert isinstance(acts, list), f"{key}: its parser could not be read ({acts})"
    cases, seen = [], set()
    for (s, pre), acts in ps.items():
        for a in acts:
            if not (k := kind(a)) and not reads_path(a): continue
            for v in (bad_values(k, typed(a)) if k else [MISSING]):
                # a config field (no argparse type: the config's own coercion checks it) is the same code in every
                # training script that has it: it is tried once, in the first script
                key = (a['dest'], v) if a['type'] is None else (s, pre, a['dest'], v)
                if key not in seen: seen.add(key); cases.append((s, pre, typed(a), a['dest'], v))
    out = tmp_path_factory.mktemp('bad')
    calls = [(f'scripts/{s}', [*pre, f, v, *required_args(ps[s, pre], out/f'{i}'), *output_args(ps[s, pre], out/f'{i}', f)], ENV)
             for i, (s, pre, f, _, v) in enumerate(cases)]
    # two interpreters side by side (one per core); each case is stopped after 20 s
    halves, results = [calls[0::2], calls[1::2]], [None, None]
    def go(i): results[i] = run_many(halves[i], timeout=1500, case_timeout=20)
    ts = [threading.Thread(target=go, args=(i,)) for i in (0, 1)]
    for t in ts: t.start()
    for t in ts: t.join()
    res = [None] * len(calls); res[0::2], res[1::2] = results
    return ps, cases, res


def test_parsers_are_read_and_the_table_is_wide(table):
    ps, cases, _ = table
    flags = {(s, f) for s, _, f, _, _ in cases}
    assert len(flags) > 150, len(flags)
    for s in ('sample.py', 'train_ldm.py', 'train_glm_image.py', 'evaluate.py', 'make_shapes.py', 'benchmark.py', 'bench_vs_diffusers.py'):
        assert any(c[0] == s for c in cases), f"{s}: no number flag found"
    assert any(c[1] for c in cases), 'the upsample stage of train_glide.py was not read'
    assert {('sample.py', f) for f in ('--guidance', '--temperature', '--top_p', '--top_k', '--steps', '--n', '--seed')} <= flags
    trained = {f for s, f in flags if s.startswith('train_')}   # a config field is tried in the first training script that has it
    assert {'--learning_rate', '--train_batch_size', '--guidance_scale', '--ema_decay'} <= trained, sorted(trained)


def refused_by_name(p:dict, script:str, flag:str, dest:str, value:str) -> bool:
    "Exit 2, no traceback, the last line `script: error: ...` naming the flag as typed, its config field, or the missing path given."
    lines = p['stderr'].strip().splitlines()
    names = {flag, flag.lstrip('-'), dest.split('.')[-1], dest.replace('|', '.').split('.')[-1]} | ({'nothing_here'} if value == MISSING else set())
    one_line = p['returncode'] == 2 and 'Traceback' not in p['stderr'] and bool(lines) and lines[-1].startswith(f'{script}: error: ')
    named = any(re.search(rf'(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])', lines[-1]) for n in names) if lines else False
    # a missing path may be preceded by another input the script needs and lacks here (its default model folder, a
    # required flag): that refusal, before any work, is as good
    return one_line and (named or (value == MISSING and bool(OTHER_FIRST.search(lines[-1]))))


def test_bad_numbers_are_refused_by_name(table):
    ps, cases, results = table
    bad = [f"{' '.join([s, *pre, f, v])} -> exit {p['returncode']}: {(p['stderr'].strip().splitlines() or ['(nothing on stderr)'])[-1][:300]}"
           for (s, pre, f, d, v), p in zip(cases, results) if not refused_by_name(p, s, f, d, v)]
    (ROOT/'.pytest_bad_flags.txt').write_text('\n'.join(bad)) if bad and 'KEEP_FLAG_REPORT' in __import__('os').environ else None
    assert not bad, f"{len(bad)} of {len(cases)} bad values were not refused in one line naming the flag:\n" + '\n'.join(bad)
