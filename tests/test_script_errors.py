"Every script against a table of bad values and files a user may give it: each is one line `SCRIPT: error: ...` and exit 2, never a traceback (all cases in one interpreter: they end before any work starts)."
import pytest

from conftest import run_many


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
    "What users hand over by mistake: a KL VAE where a VQ model goes, a latent diffusion folder where a GLIDE one goes, a file, text that is not UTF-8."
    from diffusers import AutoencoderKL
    from imagegen.autoencoders.kl import tiny_vae_config
    from imagegen.diffusion.ldm import LatentDiffusion, LDMConfig
    d = tmp_path_factory.mktemp('inputs')
    AutoencoderKL(**tiny_vae_config(base_channels=16)).save_pretrained(d/'kl')
    LatentDiffusion.from_config(LDMConfig.preset('tiny'), corpus=['a red circle']).save_pretrained(d/'ldm')
    from diffusers import VQModel
    from imagegen.autoencoders.vq import vq_model_config
    VQModel(**vq_model_config(codebook_size=64, code_dim=3)).save_pretrained(d/'vq')
    (d/'a_file').write_text('x')
    (d/'latin1.txt').write_bytes('caf\xe9'.encode('latin-1'))
    (d/'samples').mkdir(); (d/'samples'/'samples.jsonl').write_text('{"file_name": ')
    return d


CASES = [   # (script, flags, what the one line must say); {d}: the folders above, {o}: a fresh output folder
    ('make_shapes.py', ['--out', '{o}', '--n_train', '-5'], '--n_train -5: must be >= 0'),
    ('make_shapes.py', ['--out', '{o}', '--samples_per_shard', '0'], '--samples_per_shard 0: must be >= 1'),
    ('make_shapes.py', ['--out', '{o}', '--resolution', '0'], '--resolution 0: must be >= 8'),
    ('make_shapes.py', ['--out', '{d}/a_file'], 'is a file'),
    ('make_shapes.py', ['--out', '{o}', '--seed', '-1'], '--seed -1: must be >= 0'),
    ('evaluate.py', ['--samples', '{d}/samples'], 'samples.jsonl:1: not valid JSON'),
    ('evaluate.py', ['--samples', '{d}/no_such'], 'not found'),
    ('export_checkpoint.py', ['--run', '{d}/ldm', '--output_dir', '{o}', '--ema', 'maybe'], "argument --ema: 'maybe'"),
    ('export_checkpoint.py', ['--run', '{d}/ldm', '--output_dir', '{o}', '--step', 'abc'], "argument --step: 'abc'"),
    ('export_checkpoint.py', ['--run', '{d}/ldm', '--out', '{o}'], 'the following arguments are required: --output_dir'),
    ('export_checkpoint.py', ['--run', '{d}/ldm', '--output_dir', '{d}/ldm'], 'is not an empty folder'),
    ('train_gpt.py', ['--output_dir', '{o}', '--vqvae', '{d}/kl', '--dataset', 'shapes:n=64'], "names the class 'AutoencoderKL', not 'VQModel'"),
    ('train_gpt.py', ['--output_dir', '{o}', '--vqvae', '/no/such/vqvae', '--dataset', 'shapes:n=64'], 'checked before any download'),
    ('train_gpt.py', ['--output_dir', '{o}', '--dataset', 'shapes:n=8', '--train_batch_size', '32'], 'the data loader gave no batch'),
    ('train_gpt.py', ['--output_dir', '{d}/a_file/run', '--vqvae', '{d}/vq', '--dataset', 'shapes:n=64'], 'cannot write in output_dir'),
    ('train_grpo.py', ['--output_dir', '{d}/a_file/run', '--pretrained_model_name_or_path', '{d}/ldm'], 'cannot write in output_dir'),
    ('train_glide.py', ['--output_dir', '{o}', '--pretrained_model_name_or_path', '{d}/ldm', '--dataset', 'shapes:n=64'], "not GLIDE's text transformer"),
    ('train_ldm.py', ['--output_dir', '{o}', '--train_data_dir', 'data/shapes/train'], 'does not exist'),
    ('train_ldm.py', ['--output_dir', '{o}', '--tags', 'notakv'], "cannot read 'notakv'"),
    ('train_ldm.py', ['--output_dir', '{o}', '--seed', '-1'], 'TrainConfig.seed=-1: must be in [0, 2**32)'),
    ('train_grpo.py', ['--output_dir', '{o}', '--pretrained_model_name_or_path', '{d}/ldm', '--reward', 'oracle=1,,ocr'], "cannot read ''"),
    ('train_grpo.py', ['--output_dir', '{o}', '--pretrained_model_name_or_path', '{d}/ldm', '--reward', 'oracle=high'], "expected float, got 'high'"),
    ('train_grpo.py', ['--output_dir', '{o}', '--pretrained_model_name_or_path', '{d}/ldm', '--prompts', '{d}/latin1.txt'], 'latin1.txt is not UTF-8 text'),
]


@pytest.fixture(scope='module')
def results(folders, tmp_path_factory):
    calls = []
    for i, (script, flags, _) in enumerate(CASES):
        o = tmp_path_factory.mktemp(f'out{i}')/'run'
        calls.append((f'scripts/{script}', [f.format(d=folders, o=o) for f in flags] + (['--report_to', 'none'] if script.startswith('train') else []),
                      {'HF_HUB_OFFLINE': '1'}))
    return run_many(calls)


@pytest.mark.parametrize('i', range(len(CASES)), ids=[f"{c[0]} {' '.join(c[1][-2:])}" for c in CASES])
def test_one_line_and_exit_2(results, i):
    script, _, expect = CASES[i]
    p = results[i]
    lines = p['stderr'].strip().splitlines()
    assert p['returncode'] == 2 and 'Traceback' not in p['stderr'], p['stderr'][-3000:]
    assert lines and lines[-1].startswith(f'{script}: error: ') and expect in lines[-1], p['stderr'][-3000:]
