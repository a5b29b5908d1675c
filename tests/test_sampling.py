"Sampling: parity with diffusers' StableDiffusionPipeline, every sampler, seeds, guidance, distributed order."
from conftest import two_ranks
import subprocess, sys
from pathlib import Path
import os, tempfile
from pathlib import Path
import pytest, torch
from imagegen.autoencoders.kl import ImageAutoencoder
from imagegen.diffusion.sampling import SAMPLERS, make_generators, make_scheduler, sample, sample_distributed, tiny_sd_components, to_pipeline
from imagegen.grids import make_grid, save_grid

PROMPTS = ['a red circle', 'a blue square', 'two green dots']

@pytest.fixture(scope='module')
def comps(): return tiny_sd_components(seed=0)

def ours(c, name, prompts=PROMPTS, seeds=(0, 1, 2), **kw):
    kw = {'guidance_scale': 5.0, 'steps': 5, 'output': 'pt', 'progress': False, **kw}
    return sample(c['unet'], make_scheduler(name, c['scheduler']), (c['tokenizer'], c['text_encoder']), prompts,
                  autoencoder=ImageAutoencoder(c['vae']), generator=make_generators(seeds), **kw)

@pytest.mark.parametrize('name,guidance,neg', [('ddim', 5.0, None), ('euler_a', 7.0, 'blurry'), ('dpmpp_2m_karras', 3.0, None),
                                               ('plms', 5.0, 'red'), ('heun', 2.0, None), ('ddpm', 1.0, None), ('unipc', 4.0, None)])
def test_parity_with_pipeline(comps, name, guidance, neg):
    pipe = to_pipeline(**comps)
    pipe.scheduler = make_scheduler(name, comps['scheduler'])
    ref = pipe(PROMPTS, negative_prompt=None if neg is None else [neg] * 3, num_inference_steps=5, guidance_scale=guidance,
               generator=make_generators([0, 1, 2]), output_type='pt').images
    got = ours(comps, name, guidance_scale=guidance, negative_prompt=neg)
    assert got.shape == ref.shape == (3, 3, 32, 32)
    assert (got - ref).abs().max() < 1e-5

def test_parity_pil(comps):
    pipe = to_pipeline(**comps)
    pipe.scheduler = make_scheduler('euler', comps['scheduler'])
    ref = pipe(PROMPTS[:2], num_inference_steps=3, guidance_scale=4.0, generator=make_generators([5, 6])).images
    got = ours(comps, 'euler', PROMPTS[:2], seeds=[5, 6], steps=3, guidance_scale=4.0, output='pil')
    import numpy as np
    for a, b in zip(got, ref): assert np.abs(np.asarray(a).astype(int) - np.asarray(b).astype(int)).max() <= 1

@pytest.mark.parametrize('name', list(SAMPLERS))
def test_every_sampler_runs(comps, name):
    x = ours(comps, name, PROMPTS[:1], seeds=[0], steps=3, height=24, width=40, eta=0.3)
    assert x.shape == (1, 3, 24, 40) and torch.isfinite(x).all() and x.std() > 0

def test_per_image_seed_independent_of_batch(comps):
    batch = ours(comps, 'euler_a', seeds=[10, 11, 12])
    alone = ours(comps, 'euler_a', PROMPTS[2:], seeds=[12])
    chunked = ours(comps, 'euler_a', seeds=[10, 11, 12], batch_size=2)
    assert (batch[2:] - alone).abs().max() < 1e-5
    assert (batch - chunked).abs().max() < 1e-5
    other = ours(comps, 'euler_a', PROMPTS[2:], seeds=[13])
    assert (other - alone).abs().max() > 1e-3

def test_guidance_one_does_not_double_batch(comps):
    sizes = []
    h = comps['unet'].register_forward_hook(lambda m, a, o: sizes.append(a[0].shape[0]))
    try:
        ours(comps, 'ddim', steps=2, guidance_scale=1.0)
        ours(comps, 'ddim', steps=2, guidance_scale=2.0)
    finally: h.remove()
    assert sizes == [3, 3, 6, 6]

def test_negative_prompt_changes_output(comps):
    plain = ours(comps, 'ddim', steps=3)
    neg = ours(comps, 'ddim', steps=3, negative_prompt='a yellow star')
    assert (plain - neg).abs().max() > 1e-3

def test_custom_encode_callable(comps):
    from imagegen.diffusion.sampling import clip_encoder
    enc = clip_encoder(comps['tokenizer'], comps['text_encoder'])
    a = ours(comps, 'ddim', steps=2)
    b = sample(comps['unet'], make_scheduler('ddim', comps['scheduler']), enc, PROMPTS, autoencoder=ImageAutoencoder(comps['vae']), guidance_scale=5.0,
               steps=2, output='pt', progress=False, generator=make_generators([0, 1, 2]))
    assert (a - b).abs().max() < 1e-6
    bad = lambda ps: torch.zeros(len(ps), 3 + len(ps[0]), 32)
    with pytest.raises(ValueError, match='pad to a fixed length'):
        sample(comps['unet'], comps['scheduler'], bad, ['long prompt'], autoencoder=ImageAutoencoder(comps['vae']), steps=1, progress=False)

def _two_ranks(worker:str, out): two_ranks(__file__, worker, out)

def _distributed_worker(out):
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    c = tiny_sd_components(seed=0)
    ims = sample_distributed(acc, c['unet'], make_scheduler('euler_a', c['scheduler']), (c['tokenizer'], c['text_encoder']),
                             PROMPTS, [0, 1, 2], autoencoder=ImageAutoencoder(c['vae']), steps=3, guidance_scale=4.0, output='pt', progress=False)
    if acc.is_main_process: torch.save({'ims': torch.stack(ims), 'n': acc.num_processes}, out)

def test_distributed_matches_single_process(comps, tmp_path):
    out = tmp_path/'ims.pt'
    _two_ranks('_distributed_worker', out)
    got = torch.load(out)
    assert got['n'] == 2
    ref = ours(comps, 'euler_a', steps=3, guidance_scale=4.0)
    assert (got['ims'] - ref).abs().max() < 1e-5

def test_grid_size(tmp_path):
    g = make_grid(torch.rand(5, 3, 20, 30), ncols=2)
    assert g.size == (2 * 32 + 2, 3 * 22 + 2)
    g2 = make_grid(torch.rand(5, 3, 20, 30), captions=['x'] * 5, ncols=2)
    assert g2.width == g.width and g2.height > g.height
    p = save_grid(torch.rand(2, 3, 8, 8), tmp_path/'g'/'grid.png', ['a', 'b'], ncols=2)
    assert p.exists()
