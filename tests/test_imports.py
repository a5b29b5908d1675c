"""The package's modules form no import circle: every `import` of an `imagegen` module, at the top of a file or inside a
function, is an edge, and the graph of edges has no cycle. Families never import one another."""
from __future__ import annotations
import ast
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT/'imagegen'
FAMILIES = ('diffusion', 'ar')   # model families: they never import each other (first stages in autoencoders/ sit below both; rl, models, hybrid above)

def module_name(path:Path) -> str:
    parts = path.relative_to(ROOT).with_suffix('').parts
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)

def imported_modules(path:Path, known:set[str]) -> set[str]:
    "The imagegen modules `path` imports anywhere in its body (relative imports resolved; `from pkg import mod` counts as mod)."
    me = module_name(path)
    package = me if path.name == '__init__.py' else me.rpartition('.')[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import): names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ''
            if node.level:
                pkg = package.split('.')
                base = '.'.join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else: continue
        for n in names:
            while n and n not in known: n = n.rpartition('.')[0]
            if n and n != me and n != 'imagegen': out.add(n)
    return out

def import_graph() -> dict[str, set[str]]:
    files = [p for p in PKG.rglob('*.py') if p.name != '_modidx.py']
    known = {module_name(p) for p in files}
    return {module_name(p): imported_modules(p, known) for p in files}

def find_cycle(graph:dict[str, set[str]]) -> list[str]|None:
    "One cycle of `graph` as a list of modules, or None."
    state, stack = {}, []
    def visit(n):
        state[n] = 'open'; stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 'open': return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)): return c
        state[n] = 'done'; stack.pop()
        return None
    for n in sorted(graph):
        if n not in state and (c := visit(n)): return c
    return None

def test_find_cycle_sees_a_circle():
    assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
    assert find_cycle({'a': {'b'}, 'b': set()}) is None

def test_function_level_imports_count(tmp_path):
    f = tmp_path/'imagegen'/'x.py'; f.parent.mkdir()
    f.write_text("def g():\n    from imagegen.y import z\n    from .w import v\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try: assert imported_modules(f, {'imagegen.x', 'imagegen.y', 'imagegen.w'}) == {'imagegen.y', 'imagegen.w'}
    finally: ROOT = old

def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + ' -> '.join(cycle)

@pytest.mark.parametrize('family', FAMILIES)
def test_families_do_not_import_each_other(family):
    graph = import_graph()
    bad = {m: sorted(d for d in deps if d.split('.')[1] in FAMILIES and d.split('.')[1] != family)
           for m, deps in graph.items() if m.split('.')[1:2] == [family]}
    assert not {m: d for m, d in bad.items() if d}, bad

def test_models_is_the_only_loader():
    "No module below the registry reads another family's record file to guess a folder's family."
    for p in PKG.rglob('*.py'):
        if p.name in ('models.py', '_modidx.py'): continue
        src = p.read_text()
        others = [f for f in ('GPT_FILE', 'GLIDE_FILE', 'HYBRID_FILE') if f in src and not src.count(f"{f} = ")]
        if module_name(p) in ('imagegen.ar.task', 'imagegen.ar.edit', 'imagegen.diffusion.glide', 'imagegen.diffusion.upsampler', 'imagegen.hybrid'):
            continue   # a family reads its own record
        assert not others, f"{p.relative_to(ROOT)} reads {others}: load models with imagegen.models.load_model"
