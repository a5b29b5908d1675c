"""Every flagged notebook cell runs with its own flag alone: `nbdev_test --flags cuda` runs the unflagged cells and the
`cuda` ones, so a `#| cuda` cell that uses a name defined only in a `#| slow` cell stops that run with a NameError
(as `nbs/02c_loop.ipynb`'s did on a GPU machine). This reads every notebook's cells statically, with `symtable`."""
from __future__ import annotations
import configparser, json, re, symtable
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT/'nbs').glob('*.ipynb')) + sorted((ROOT/'nbs'/'scripts').glob('*.ipynb'))

def test_flags() -> set[str]:
    "The notebook test flags of settings.ini (`tst_flags`)."
    cfg = configparser.ConfigParser(); cfg.read(ROOT/'settings.ini')
    return set(cfg['DEFAULT']['tst_flags'].split())
test_flags.__test__ = False   # a helper, not a test

def _directives(src:str) -> dict[str, list[str]]:
    "nbdev's reading of `#| key args` lines: a cell is skipped when one of its keys is a test flag not asked for."
    return {w[0].rstrip(':'): w[1:] for l in src.splitlines() if l.startswith('#|') and (w := l[2:].split())}

def _names(src:str) -> tuple[set[str], set[str]]:
    "(names the cell defines at module level, names it reads from the module's globals)."
    code = '\n'.join('' if l.lstrip().startswith(('%', '!')) else l for l in src.splitlines())
    top = symtable.symtable(code, '<cell>', 'exec')
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    used = {s.get_name() for s in top.get_symbols() if s.is_referenced()} - defined
    todo = list(top.get_children())
    while todo:   # functions, classes, lambdas and comprehensions: the globals they read
        t = todo.pop(); todo += t.get_children()
        used |= {s.get_name() for s in t.get_symbols() if s.is_referenced() and s.is_global() and not s.is_declared_global()}
    return defined, used - defined

def flag_problems(nb:dict, flags:set[str]) -> list[str]:
    "Cells of `nb` that use a name defined, before them, only in cells of flags they do not have."
    where: dict[str, list[frozenset]] = {}   # name -> the flag sets of the earlier cells that define it
    problems = []
    for i, c in enumerate(nb['cells']):
        if c['cell_type'] != 'code': continue
        src = ''.join(c['source'])
        ds = _directives(src)
        if [a.lower() for a in ds.get('eval', [])][:1] == ['false']: continue
        mine = frozenset(k for k in ds if k in flags)
        try: defined, used = _names(src)
        except SyntaxError: continue   # IPython syntax beyond magics: nbdev_test reports those itself
        for name in sorted(used):
            seen = where.get(name)
            if seen and not any(g <= mine for g in seen):
                others = ' / '.join(sorted('#| ' + ' '.join(sorted(g)) for g in seen))
                problems.append(f"cell {i} ({'#| ' + ' '.join(sorted(mine)) if mine else 'unflagged'}) uses `{name}`, "
                                f"defined before it only in {others} cells")
        for name in defined: where.setdefault(name, []).append(mine)
    return problems

def _nb(*cells:str) -> dict:
    return {'cells': [{'cell_type': 'code', 'source': s} for s in cells]}

def test_flag_problems_finds_a_cuda_cell_that_needs_a_slow_one():
    flags = {'slow', 'cuda', 'notest', 'multigpu'}
    broken = _nb("import torch", "#| slow\nclass Denoise:\n    pass\nx = 1", "#| cuda\nclass OnGPU(Denoise): pass\nprint(x)")
    p = flag_problems(broken, flags)
    assert len(p) == 2 and "uses `Denoise`, defined before it only in #| slow cells" in p[0] and '`x`' in p[1], p
    fixed = _nb("import torch\nclass Denoise:\n    pass", "#| slow\nx = 1", "#| cuda\nclass OnGPU(Denoise): pass")
    assert flag_problems(fixed, flags) == []
    # a cell of two flag lines runs only when both are asked for; "#| slow cuda" is nbdev's key `slow` (with an argument)
    both = _nb("#| slow\n#| cuda\ny = 2", "#| cuda\nprint(y)", "#| cuda\n#| slow\nprint(y)", "#| slow cuda\nprint(y)")
    assert len(flag_problems(both, flags)) == 2
    # names local to a function, or read inside one before the module defines them elsewhere, are not the module's
    local = _nb("#| slow\nz = 1", "def f(z): return [z for _ in range(2)]", "#| eval: false\nprint(z)", "%time 1")
    assert flag_problems(local, flags) == []
    assert flag_problems(_nb("#| slow\nz = 1", "f = lambda: z"), flags) and flag_problems(_nb("#| slow\nz = 1", "[z for _ in ()]"), flags)

@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT/'nbs')))
def test_flagged_cells_run_with_their_flag_alone(path):
    nb = json.loads(path.read_text())
    assert flag_problems(nb, test_flags()) == []
