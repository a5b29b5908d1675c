"""The interactive generation panel (`imagegen.interactive`): driven from Python, and clicked in a real JupyterLab.

The browser test starts JupyterLab on 127.0.0.1 (free port, random token), opens a notebook that builds the panel from
a tiny saved model in Debian's Chromium through Playwright, clicks Generate and waits for the grid image. It needs the
`chromium` Debian package (installed with apt-get when missing and possible) and the `playwright` pip package (its own
browser download is never used). Set IMAGEGEN_ARTIFACTS=DIR to keep the screenshot.
"""
import json, os, secrets, shutil, signal, socket, subprocess, sys, time, urllib.request
from pathlib import Path
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = '/usr/bin/chromium'
CHROMIUM_FLAGS = ['--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
                  '--disable-sync', '--disable-dev-shm-usage']
CORPUS = [f"a {s} {c} {k}" for s in ('small', 'large') for c in ('red', 'green', 'blue') for k in ('circle', 'square', 'triangle')]


@pytest.fixture(scope='module')
def ldm():
    from imagegen.diffusion.ldm import LatentDiffusion, LDMConfig
    cfg = LDMConfig.preset('tiny', text_hidden=32, text_layers=1, text_max_length=12, block_out_channels=(32, 64))
    return LatentDiffusion.from_config(cfg, corpus=CORPUS)


def make_ui(model, **kw):
    from imagegen.interactive import GenerationUI
    return GenerationUI(model, **{'prompt': 'a red circle', 'sampler': 'ddim', 'steps': 3, 'batch_size': 2, **kw})


# ---------------------------------------------------------------- headless: the widget callbacks, no browser

def test_generate_fills_grid_and_progress(ldm):
    ui = make_ui(ldm, batch_size=3)
    ui.button.click()
    assert ui.error is None, ui.status.value
    assert len(ui.images) == 3 and all(im.size == (32, 32) for im in ui.images)
    assert ui.image.value[:8] == b'\x89PNG\r\n\x1a\n'
    assert ui.grid.width >= 3 * 128                    # 32-px samples are upscaled for display
    assert (ui.progress.value, ui.progress.max, ui.progress.bar_style) == (3, 3, 'success')
    assert 'Done: 3 image(s)' in ui.status.value
    assert len(ui.verdicts) == 3 and 'Shapes oracle' in ui.verdict.value
    assert not ui.button.disabled
    ui.batch_size.value = 1
    ui.button.click()
    assert len(ui.images) == 1


def test_progress_moves_during_sampling(ldm):
    ui, seen = make_ui(ldm, steps=4), []
    step = ui._on_step
    ui._on_step = lambda i, n: (step(i, n), seen.append((ui.progress.value, ui.progress.max)))
    ui.button.click()
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_seed_determinism(ldm):
    ui = make_ui(ldm, batch_size=3, seed=10)
    ui.button.click()
    a = [np.asarray(im) for im in ui.images]
    ui.button.click()
    assert all((x == np.asarray(y)).all() for x, y in zip(a, ui.images))
    assert not (a[0] == a[1]).all()
    ui.seed.value, ui.batch_size.value = 11, 1          # image i of a batch uses seed + i
    ui.button.click()
    assert (np.asarray(ui.images[0]) == a[1]).all()
    ui.seed.value = 12
    ui.sampler.value = 'euler_a'                         # a stochastic sampler is seeded too
    ui.button.click(); b = np.asarray(ui.images[0])
    ui.button.click()
    assert (np.asarray(ui.images[0]) == b).all()


@pytest.mark.parametrize('field,value,words', [('steps', 0, 'Steps'), ('batch_size', 0, 'Batch size'),
                                               ('seed', -3, 'Seed'), ('guidance', -1.0, 'Guidance')])
def test_bad_input_is_shown_in_the_panel(ldm, field, value, words):
    ui = make_ui(ldm)
    ui.button.click()
    assert len(ui.images) == 2
    getattr(ui, field).value = value
    ui.button.click()                                    # must not raise
    assert 'Generation failed' in ui.status.value and words in ui.status.value
    assert ui.images == [] and ui.image.value == b'' and ui.progress.bar_style == 'danger'
    assert isinstance(ui.error, ValueError) and not ui.button.disabled


def test_model_error_is_shown_with_traceback():
    def broken(request, callback=None): raise RuntimeError('out of memory (simulated)')
    ui = make_ui(broken)
    ui.button.click()
    assert 'RuntimeError: out of memory (simulated)' in ui.status.value and '<details>' in ui.status.value
    short = make_ui(lambda request, callback=None: [])
    short.button.click()
    assert 'returned 0 images for a batch size of 2' in short.status.value


def test_from_saved_folder(ldm, tmp_path):
    ldm.save_pretrained(tmp_path/'model')
    ui = make_ui(str(tmp_path/'model'), device='cpu', batch_size=1, seed=4)
    ui.button.click()
    direct = make_ui(ldm, batch_size=1, seed=4)
    direct.button.click()
    assert (np.asarray(ui.images[0]) == np.asarray(direct.images[0])).all()


def test_bad_constructor_arguments(ldm):
    from imagegen.interactive import GenerationUI
    with pytest.raises(ValueError, match='Sampler'): GenerationUI(ldm, sampler='nope')
    with pytest.raises(TypeError, match='Cannot generate with a int'): GenerationUI(3)


# ---------------------------------------------------------------- real browser: JupyterLab + Chromium + Playwright

def chromium_or_skip() -> str:
    "Path of Debian's chromium, installed with apt-get when missing; skip (saying why) where that is impossible."
    if Path(CHROMIUM).exists(): return CHROMIUM
    apt = shutil.which('apt-get')
    if apt is None or os.geteuid() != 0: pytest.skip(f"{CHROMIUM} is missing and cannot be installed here (needs root and apt-get): apt-get install chromium")
    env = {**os.environ, 'DEBIAN_FRONTEND': 'noninteractive'}
    p = subprocess.run([apt, 'install', '-y', '-q', 'chromium'], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        subprocess.run([apt, 'update', '-q'], env=env, capture_output=True)
        p = subprocess.run([apt, 'install', '-y', '-q', 'chromium'], env=env, capture_output=True, text=True)
    if p.returncode != 0 or not Path(CHROMIUM).exists(): pytest.skip(f"apt-get install chromium failed:\n{p.stderr[-1500:]}")
    return CHROMIUM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def api(base:str, token:str, path:str, data:dict|None=None, method:str|None=None) -> dict:
    req = urllib.request.Request(base + path, method=method or ('POST' if data is not None else 'GET'),
                                 data=None if data is None else json.dumps(data).encode(),
                                 headers={'Authorization': f'token {token}', 'Content-Type': 'application/json'})
    with urllib.request.urlopen(req, timeout=10) as r: return json.loads(r.read() or b'{}')


def write_notebook(path:Path, model_dir:Path):
    import nbformat
    code = ("from imagegen.interactive import GenerationUI\n"
            f"ui = GenerationUI({str(model_dir)!r}, device='cpu', prompt='a small red circle on the left', sampler='ddim',\n"
            "                  steps=4, guidance=3.0, seed=0, batch_size=3)\n"
            "ui")
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)],
                                            metadata={'kernelspec': {'name': 'python3', 'display_name': 'Python 3', 'language': 'python'}}), path)


@pytest.fixture
def browser_tools():
    "(chromium path, playwright.sync_api), or a skip saying what is missing; checked before JupyterLab is started."
    chromium = chromium_or_skip()
    sync_api = pytest.importorskip('playwright.sync_api', reason="pip install playwright (its browser download is not needed: Debian's chromium is used)")
    return chromium, sync_api


@pytest.fixture
def jupyterlab(tmp_path):
    "A JupyterLab server on 127.0.0.1 serving `tmp_path/work`: yields (base_url, token, work_dir); stopped afterwards."
    work, cfg = tmp_path/'work', tmp_path/'jupyter-config'
    work.mkdir()
    news = cfg/'lab/user-settings/@jupyterlab/apputils-extension/notification.jupyterlab-settings'
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({'fetchNews': 'false', 'checkForUpdates': False}))
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, 'JUPYTER_CONFIG_DIR': str(cfg), 'JUPYTER_RUNTIME_DIR': str(tmp_path/'jupyter-runtime'),
           'IPYTHONDIR': str(tmp_path/'ipython'), 'PATH': f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           'PYTHONPATH': os.pathsep.join(filter(None, [str(ROOT), os.environ.get('PYTHONPATH')]))}
    env.pop('IN_TEST', None)
    log = open(tmp_path/'jupyterlab.log', 'w')
    proc = subprocess.Popen([sys.executable, '-m', 'jupyterlab', '--no-browser', '--ip=127.0.0.1', f'--port={port}',
                             '--port-retries=0', f'--IdentityProvider.token={token}', f'--ServerApp.root_dir={work}',
                             '--LabApp.expose_app_in_browser=True', f'--LabApp.workspaces_dir={tmp_path/"workspaces"}',
                             *(['--allow-root'] if os.geteuid() == 0 else [])],
                            cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f'http://127.0.0.1:{port}'
    try:
        t0 = time.monotonic()
        while proc.poll() is None and not _up(base, token) and time.monotonic() - t0 < 90: time.sleep(0.2)
        if proc.poll() is not None or not _up(base, token):
            raise AssertionError(f"JupyterLab did not start:\n{(tmp_path/'jupyterlab.log').read_text()[-3000:]}")
        yield base, token, work
    finally:
        stop(proc)
        log.close()


def stop(proc:subprocess.Popen):
    "SIGTERM the server's process group (server and kernels), SIGKILL after 20 s."
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try: os.killpg(proc.pid, sig)
        except ProcessLookupError: return
        try: proc.wait(timeout=wait); return
        except subprocess.TimeoutExpired: pass


def _up(base, token) -> bool:
    try: api(base, token, '/api/status'); return True
    except OSError: return False


def test_generate_in_jupyterlab(ldm, browser_tools, jupyterlab, tmp_path):
    "Run the notebook in JupyterLab, click Generate in Chromium, wait for the grid; screenshot to tmp_path (and IMAGEGEN_ARTIFACTS)."
    (chromium, sync_api), (base, token, work) = browser_tools, jupyterlab
    ldm.save_pretrained(work/'model')
    write_notebook(work/'ui.ipynb', work/'model')
    # the kernel session exists before the page opens, so that Run All never races the kernel start
    api(base, token, '/api/sessions', {'path': 'ui.ipynb', 'name': 'ui.ipynb', 'type': 'notebook', 'kernel': {'name': 'python3'}})
    shot = tmp_path/'interactive_jupyterlab.png'
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={'width': 1280, 'height': 1100})
            page.goto(f'{base}/lab/tree/ui.ipynb?token={token}', timeout=90_000)
            page.wait_for_selector('.jp-NotebookPanel .jp-Cell', timeout=90_000)
            page.wait_for_function("() => window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel?.status === 'idle'",
                                   timeout=90_000)
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            button = page.locator('.jp-OutputArea-output button.jupyter-button', has_text='Generate')
            button.wait_for(state='visible', timeout=90_000)
            assert page.locator('.jp-OutputArea-output img').evaluate_all(
                "ims => ims.every(i => !(i.naturalWidth > 0))"), "an image is shown before Generate was clicked"
            button.click()
            page.wait_for_function("() => [...document.querySelectorAll('.jp-OutputArea-output .widget-html')]"
                                   ".some(e => /Done: |Generation failed/.test(e.textContent))", timeout=60_000)
            page.wait_for_timeout(300)
            page.screenshot(path=str(shot), full_page=True)
            status = page.locator('.jp-OutputArea-output .widget-html').all_text_contents()
            sizes = page.locator('.jp-OutputArea-output img').evaluate_all(
                "ims => ims.map(i => [i.naturalWidth, i.naturalHeight, i.getBoundingClientRect().width, i.getBoundingClientRect().height])")
            bars = page.locator('.jp-OutputArea-output .widget-hprogress').evaluate_all(   # ours has a 'step/total' label
                "es => es.map(e => [e.textContent.trim(), e.querySelector('.progress-bar').style.width, e.querySelector('.progress-bar').className])")
        finally: browser.close()
    if os.environ.get('IMAGEGEN_ARTIFACTS'):
        dest = Path(os.environ['IMAGEGEN_ARTIFACTS']); dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, dest/shot.name)
    text = ' '.join(status)
    assert 'Done: 3 image(s)' in text, f"status in the page: {status}"
    assert 'Shapes oracle' in text and 'seed 2' in text, f"no verdict table in the page: {status}"
    big = [s for s in sizes if s[0] >= 3 * 128 and s[1] >= 128 and s[2] >= 3 * 128 and s[3] >= 128]
    assert len(big) == 1, f"expected one grid image of >= 384x128 px shown at >= that size; (natural w, h, shown w, h) = {sizes}"
    ours = [b for b in bars if '/' in b[0]]
    assert len(ours) == 1 and ours[0][:2] == ['4/4', '100%'] and 'success' in ours[0][2], f"progress bars (label, width, class): {bars}"
    assert shot.stat().st_size > 10_000
