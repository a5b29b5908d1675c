"Bad data never kills a run: planted bad files are converted or skipped, counted, reported by name, and too many raise."
import io, json, logging, tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from imagegen.data import BadDataError, make_dataloader, make_dataset, open_image, BadImage
from imagegen.shapes import ShapesDataset


def _png(img, fmt='PNG'):
    b = io.BytesIO(); img.save(b, fmt); return b.getvalue()


GOOD = _png(Image.new('RGB', (48, 48), (200, 30, 30)))
CONVERTED = {  # kinds that are converted to RGB and kept
    'gray.png': _png(Image.new('L', (40, 40), 100)),
    'rgba.png': _png(Image.new('RGBA', (40, 40), (255, 0, 0, 128))),
    'palette.png': _png(Image.new('RGB', (40, 40), 'blue').convert('P')),
    'sixteen.png': _png(Image.fromarray(np.full((40, 40), 40000, np.uint16))),
    'cmyk.jpg': _png(Image.new('CMYK', (40, 40), (0, 255, 0, 0)), 'JPEG'),
}
SKIPPED = {  # kinds that are skipped, with the reason they must report
    'truncated.png': (GOOD[:len(GOOD) // 2], 'not a readable image'),
    'corrupt.jpg': (b'\xff\xd8\xff' + bytes(200), 'not a readable image'),
    'text.png': (b'this is not an image', 'not a readable image'),
    'tiny.png': (_png(Image.new('RGB', (4, 4))), 'too small'),
    'huge.png': (_png(Image.new('RGB', (1100, 1000))), 'too large'),
}


def _folder(root: Path, n_good=60, extra_bad=()):
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n_good):
        (root/f'g{i}.png').write_bytes(GOOD); lines.append({'file_name': f'g{i}.png', 'text': f'good {i}'})
    for name, data in CONVERTED.items():
        (root/name).write_bytes(data); lines.append({'file_name': name, 'captions': [f'a {name}', '']})
    for name, (data, _) in SKIPPED.items():
        (root/name).write_bytes(data); lines.append({'file_name': name, 'text': 'bad'})
    (root/'notes.txt').write_text('hello'); lines.append({'file_name': 'notes.txt', 'text': 'a text file'})
    (root/'nocap.png').write_bytes(GOOD); lines.append({'file_name': 'nocap.png'})
    (root/'emptycap.png').write_bytes(GOOD); lines.append({'file_name': 'emptycap.png', 'text': '   '})
    lines.append({'file_name': 'missing.png', 'text': 'x'})
    for name in extra_bad:
        (root/name).write_bytes(b'garbage'); lines.append({'file_name': name, 'text': 'bad'})
    text = '\n'.join(json.dumps(l) for l in lines) + '\n{not json\n'
    (root/'metadata.jsonl').write_text(text)
    return root


KW = dict(max_pixels=1_000_000, min_side=8)


def test_folder_bad_files_are_skipped_counted_and_named(tmp_path, caplog):
    root = _folder(tmp_path/'f', n_good=200)
    src = make_dataset(str(root), 32, max_bad_frac=0.2, **KW)
    with caplog.at_level(logging.WARNING, logger='imagegen.data'):
        keys = [src[i]['key'] for i in range(len(src))]
    s = src.log.summary()
    skipped = dict(s['skipped_files'])
    for name, (_, reason) in SKIPPED.items(): assert reason in skipped[name], (name, skipped.get(name))
    assert 'not an image file' in skipped['notes.txt'] and 'caption' in skipped['nocap.png']
    assert 'caption' in skipped['emptycap.png'] and 'not found' in skipped['missing.png']
    assert any('invalid JSON' in r for r in skipped.values())
    assert {n for n, _ in s['converted_files']} == set(CONVERTED)
    assert set(CONVERTED) <= set(keys) and not set(SKIPPED) & set(keys)
    assert 'skipped truncated.png' in caplog.text
    assert s['skipped'] == len(SKIPPED) + 5


def test_converted_images_are_rgb(tmp_path):
    for name, data in CONVERTED.items():
        img, note = open_image(data)
        assert img.mode == 'RGB' and note.startswith('converted'), name
    assert open_image(CONVERTED['sixteen.png'])[0].getpixel((0, 0)) == (156, 156, 156)
    assert open_image(CONVERTED['rgba.png'])[0].getpixel((0, 0))[1] > 100     # composited on white


def test_folder_too_many_bad_raises_clear_error(tmp_path):
    root = _folder(tmp_path/'f', n_good=30, extra_bad=[f'x{i}.png' for i in range(10)])
    src = make_dataset(str(root), 32, max_bad_frac=0.3, **KW)    # metadata problems alone stay under 30%
    with pytest.raises(BadDataError, match=r'(?s)samples of .* are bad .*max_bad_frac.*truncated\.png'):
        for i in range(len(src)): src[i]
    with pytest.raises(BadDataError, match='max_bad_frac'):     # metadata problems over 5%: at creation
        make_dataset(str(root), 32, max_bad_frac=0.05, **KW)


def test_folder_errors_name_the_problem(tmp_path):
    (tmp_path/'empty').mkdir()
    with pytest.raises(FileNotFoundError, match='metadata.jsonl'): make_dataset(str(tmp_path/'empty'), 32)


def _shard(path: Path, samples):
    with tarfile.open(path, 'w') as tf:
        for key, parts in samples:
            for ext, data in parts.items():
                ti = tarfile.TarInfo(f'{key}.{ext}'); ti.size = len(data); tf.addfile(ti, io.BytesIO(data))


def _shards(d: Path, n_good=60):
    d.mkdir(parents=True, exist_ok=True)
    good = [(f'g{i:04d}', {'png': GOOD, 'txt': f'good {i}'.encode()}) for i in range(n_good)]
    conv = [(n.split('.')[0], {n.split('.')[1]: data, 'json': json.dumps({'caption': n}).encode()}) for n, data in CONVERTED.items()]
    bad = [(n.split('.')[0], {n.split('.')[1]: data, 'txt': b'bad'}) for n, (data, _) in SKIPPED.items()]
    bad += [('nocap', {'png': GOOD}), ('emptycap', {'png': GOOD, 'txt': b'  '}), ('noimage', {'txt': b'x', 'bin': b'1'}),
            ('badjson', {'png': GOOD, 'json': b'{oops'})]
    _shard(d/'a-000.tar', good[:30] + conv)
    _shard(d/'a-001.tar', good[30:] + bad)
    full = d/'a-002.tar'
    _shard(full, [(f't{i:04d}', {'png': GOOD, 'txt': b'trunc'}) for i in range(10)])
    data = full.read_bytes(); full.write_bytes(data[:len(data) // 2 + 100])       # truncated shard
    (d/'a-003.tar').write_bytes(b'not a tar file at all' * 10)                      # corrupt shard
    return d


def test_shards_bad_samples_and_truncated_shards(tmp_path, caplog):
    d = _shards(tmp_path/'s')
    src = make_dataset(str(d/'a-{000..003}.tar'), 32, resampled=False, shuffle_buffer=0, max_bad_frac=0.3, **KW)
    with caplog.at_level(logging.WARNING, logger='imagegen.data'):
        keys = [s['key'] for s in src]
    s = src.log.summary()
    skipped = dict(s['skipped_files'])
    assert sum(k.startswith('g0') for k in keys) == 60
    assert 0 < sum(k.startswith('t') for k in keys) < 10            # samples before the truncation are kept
    assert 'truncated or corrupt shard' in skipped[str(d/'a-002.tar')]
    assert 'truncated or corrupt shard' in skipped[str(d/'a-003.tar')]
    for name, (_, reason) in SKIPPED.items(): assert reason in skipped[name.split('.')[0]], name
    assert 'caption' in skipped['nocap'] and 'caption' in skipped['emptycap']
    assert 'no image' in skipped['noimage'] and 'json' in skipped['badjson']
    assert {n for n, _ in s['converted_files']} == {n.split('.')[0] for n in CONVERTED}
    assert 'a-002.tar' in caplog.text


def test_shards_too_many_bad_raises_through_workers(tmp_path):
    d = _shards(tmp_path/'s', n_good=10)
    dl = make_dataloader(str(d/'a-{000..003}.tar'), batch_size=4, resolution=32, num_workers=2, resampled=False,
                         shuffle_buffer=0, max_bad_frac=0.05, **KW)
    with pytest.raises(BadDataError, match='max_bad_frac'):
        for _ in dl: pass
