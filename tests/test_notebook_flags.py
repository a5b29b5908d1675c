"""Every flagged notebook cell runs with its own flag alone: `nbdev_test --flags cuda` runs the unflagged cells and the
`cuda` ones, so a `#| cuda` cell that uses a name defined only in a `#| slow` cell stops that run with a NameError
(as `nbs/02c_loop.ipynb`'s did on a GPU machine). This reads every notebook's cells statically, with `symtable`."""
from __future__ import annotations
import symtable
from pathlib import Path
import pytest
from execnb.nbio import dict2nb, mk_cell, read_nb
from nbdev.config import get_config
from nbdev.process import extract_directives

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT/'nbs').glob('*.ipynb')) + sorted((ROOT/'nbs'/'scripts').glob('*.ipynb'))
FLAGS = set(get_config(path=ROOT).tst_flags.split())   # settings.ini's tst_flags

def _names(src:str) -> tuple[set[str], set[str]]:
    "(names the cell defines at module level, names it reads from the module's globals)."
    code = '\n'.join('' if l.lstrip().startswith(('%', '!')) else l for l in src.splitlines())
    top = symtable.symtable(code, '<cell>', 'exec')
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    used = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    todo = list(top.get_children())
    while todo:   # functions, classes, lambdas and comprehensions: the globals they read
        t = todo.pop(); todo += t.get_children()
        used |= {s.get_name() for s in t.get_symbols() if s.is_referenced() and s.is_global() and not s.is_declared_global()}
    return defined, used - defined

def flag_problems(nb, flags:set[str]) -> list[str]:
    "Cells of `nb` (as `read_nb` gives it) that use a name defined, before them, only in cells of flags they do not have."
    where: dict[str, list[frozenset]] = {}   # name -> the flag sets of the earlier cells that define it
    problems = []
    for i, c in enumerate(nb.cells):
        if c.cell_type != 'code': continue
        ds = extract_directives(c, remove=False)   # nbdev_test skips a cell when one of these keys is a flag not asked for
        if ds.get('eval:', [''])[0].lower() == 'false': continue
        mine = frozenset(ds.keys() & flags)
        try: defined, used = _names(c.source)
        except SyntaxError: continue   # IPython syntax beyond magics: nbdev_test reports those itself
        for name in sorted(used):
            seen = where.get(name)
            if seen and not any(g <= mine for g in seen):
                others = ' / '.join(sorted('#| ' + ' '.join(sorted(g)) for g in seen))
                problems.append(f"cell {i} ({'#| ' + ' '.join(sorted(mine)) if mine else 'unflagged'}) uses `{name}`, "
                                f"defined before it only in {others} cells")
        for name in defined: where.setdefault(name, []).append(mine)
    return problems

def _nb(*cells:str): return dict2nb({'cells': [mk_cell(s) for s in cells]})

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
    # a function's own names are not the module's; an `eval: false` cell and magics are skipped; a lambda's or a
    # comprehension's free names are the module's
    local = _nb("#| slow\nz = 1", "def f(z): return [z for _ in range(2)]", "#| eval: false\nprint(z)", "%time 1")
    assert flag_problems(local, flags) == []
    assert flag_problems(_nb("#| slow\nz = 1", "f = lambda: z"), flags) and flag_problems(_nb("#| slow\nz = 1", "[z for _ in ()]"), flags)

@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT/'nbs')))
def test_flagged_cells_run_with_their_flag_alone(path):
    assert flag_problems(read_nb(path), FLAGS) == []
