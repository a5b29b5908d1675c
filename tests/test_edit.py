"""Editing end to end on real processes: scripts/train_edit.py on 2 gloo CPU ranks from a text-to-image model of each
family (ranks in sync, only rank 0 writes, the model folder each family's users load), then scripts/sample.py on
held-out Shapes edits on 2 ranks against 1 (same rows, same images), and scripts/evaluate.py's edit metrics over all
of them. The models are tiny and barely trained: these tests check the plumbing; the accuracy proof is
`make main TASK=edit` (README, nbs/experiments/04_editing.ipynb)."""
import json, sys
from pathlib import Path
import numpy as np, pytest, torch
from PIL import Image
from conftest import ROOT, run, launch, rank_records
from imagegen.edits import EDIT_KINDS, HELD_OUT_SIDES


@pytest.fixture(scope='module')
def t2i(tmp_path_factory):
    "A tiny untrained latent diffusion model and a tiny untrained latent GPT, saved as their training scripts save them."
    from diffusers import VQModel
    from imagegen.ar.task import GPTConfig, TextToImageGPT
    from imagegen.autoencoders.vq import VQTokenizer
    from imagegen.diffusion.ldm import LatentDiffusion, LDMConfig
    d = tmp_path_factory.mktemp('t2i')
    from imagegen.edits import ShapesEdits
    edits = ShapesEdits('train', n=60)      # the tokenizers know the instructions' words, as ones trained on edit data would
    corpus = [f"a {c} {k}" for c in ('red', 'green', 'blue') for k in ('circle', 'square', 'triangle')] + [p for i in range(60) for p in edits[i]['edit_prompts']]
    LatentDiffusion.from_config(LDMConfig.preset('tiny', text_hidden=32, text_layers=1), corpus=corpus).save_pretrained(d/'ldm')
    torch.manual_seed(0)
    vq = VQTokenizer(VQModel(block_out_channels=(16, 32, 32), down_block_types=('DownEncoderBlock2D',) * 3, up_block_types=('UpDecoderBlock2D',) * 3,
                             latent_channels=8, vq_embed_dim=8, num_vq_embeddings=64, norm_num_groups=8, sample_size=32))
    cfg = GPTConfig.preset('tiny', n_layer=1, n_embd=32, n_head=2, text_hidden=32, text_layers=1, vqvae='(in memory)')
    TextToImageGPT.from_config(cfg, corpus=corpus, tokenizer=vq).save_pretrained(d/'gpt')
    return d


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in module.parameters()])


def rows_and_images(folder):
    rows = [json.loads(l) for l in (Path(folder)/'samples.jsonl').read_text().splitlines()]
    return rows, [np.asarray(Image.open(Path(folder)/r['file_name']).convert('RGB')).astype(int) for r in rows]


@pytest.mark.parametrize('family', ['ldm', pytest.param('gpt', marks=pytest.mark.slow)])   # the GPT editor: --slow
def test_edit_train_two_ranks_sample_and_evaluate(t2i, family, tmp_path):
    out = tmp_path/'run'
    launch('scripts/train_edit.py', '--pretrained_model_name_or_path', t2i/family, '--output_dir', out, '--max_steps', 4,
           '--batch_size', 4, '--lr', 1e-3, '--warmup_steps', 0, '--ema_decay', 0.9, '--tracker', 'none', '--sample_every', 4,
           '--n_samples', 2, *(['--token_noise', 0.3, '--source_copy'] if family == 'gpt' else []),
           '--text_to_image_dataset', 'shapes:level=mixed', '--text_to_image_prob', 0.5, probe=tmp_path/'probe')
    r0, r1 = rank_records(tmp_path/'probe', 2)
    assert (r0['world_size'], r0['end_step']) == (2, 4)
    assert not torch.equal(r0['params_start'], r0['params']), "training did not change the model"
    torch.testing.assert_close(r0['params'], r1['params'], rtol=0, atol=0)
    torch.testing.assert_close(r0['ema'], r1['ema'], rtol=0, atol=0)
    writes1 = [p for _, p in r1['writes'] if Path(p).name != 'random_states_1.pkl']
    assert writes1 == [], f"rank 1 wrote {writes1}"
    assert (out/'samples'/'step_00000004.png').exists()
    info = json.loads((out/'model'/'run_info.json').read_text())
    assert info['config']['model']['pretrained_model_name_or_path'] == str(t2i/family)
    assert info['config']['data']['text_to_image_prob'] == 0.5    # the mix is recorded with the run (the mix itself: nbs/01c_edits)
    if family == 'ldm':   # the saved editor is the EMA every rank holds, in diffusers' InstructPix2Pix layout
        from diffusers import StableDiffusionInstructPix2PixPipeline, UNet2DConditionModel
        unet = UNet2DConditionModel.from_pretrained(out/'model', subfolder='unet')
        assert unet.config.in_channels == 8
        pipe = StableDiffusionInstructPix2PixPipeline.from_pretrained(out/'model', safety_checker=None, requires_safety_checker=False)
        assert pipe.unet.config.in_channels == 8
    else:
        meta = json.loads((out/'model'/'imagegen_gpt.json').read_text())
        cfg = json.loads((out/'model'/'transformer'/'config.json').read_text())
        assert meta['task'] == 'edit' and cfg['source_tokens'] is True and cfg['source_copy'] is True   # --source_copy
        assert meta['config']['token_noise'] == 0.3 and info['config']['model']['token_noise'] == 0.3   # --token_noise, kept with the editor
    # held-out edits: 5 on 2 ranks (3 + 2) and on one process give the same rows and images, in order
    kw = ['--model', out/'model', '--shapes_edit_split', 'test', '--n', 5, '--steps', 2, '--batch_size', 2, '--seed', 3]
    launch('scripts/sample.py', *kw, '--out', tmp_path/'two', probe=tmp_path/'sprobe')
    run([sys.executable, 'scripts/sample.py', *map(str, kw), '--out', str(tmp_path/'one')])
    (rows2, ims2), (rows1, ims1) = rows_and_images(tmp_path/'two'), rows_and_images(tmp_path/'one')
    from imagegen.edits import ShapesEdits
    truth = ShapesEdits('test', n=5, seed=3)
    assert [r['edit'] for r in rows2] == [truth[i]['edit'] for i in range(5)], "edits out of order"
    assert rows2 == rows1 and [r['seed'] for r in rows2] == list(range(3, 8))
    for a, b in zip(ims2, ims1): assert np.abs(a - b).max() <= 1
    assert (tmp_path/'two'/'sources'/'000004.png').exists() and (tmp_path/'two'/'grid.png').exists()
    s0, s1 = rank_records(tmp_path/'sprobe', 2)
    assert s1['writes'] == [], f"rank 1 wrote {s1['writes']}"
    # the edit metrics cover every edit, per kind and per side of the held-out pairs too
    run([sys.executable, 'scripts/evaluate.py', '--samples', str(tmp_path/'two'), '--feature', 'random'])
    m = json.loads((tmp_path/'two'/'metrics.json').read_text())
    n_of = lambda groups: sum(m.get(f'edit/{g}/n', 0) for g in groups)
    assert n_of(EDIT_KINDS) == 5 and n_of(f'held_out_{s}' for s in HELD_OUT_SIDES) == 5
    assert 0 <= m['edit/correct'] <= m['edit/target'] <= 1 and 0 <= m['edit/ssim'] <= 1
