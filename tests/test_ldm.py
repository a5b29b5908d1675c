"Latent diffusion: objectives, min-SNR weighting, save/load, StableDiffusionPipeline compatibility."
import pytest, torch
from diffusers import StableDiffusionPipeline
from diffusers.training_utils import compute_snr
from imagegen.diffusion.ldm import LatentDiffusion, LDMConfig, diffusion_target, loss_weights, build_scheduler

CORPUS = [f"a {c} {s}" for c in ('red', 'green', 'blue') for s in ('circle', 'square', 'triangle')]
SMALL = dict(text_hidden=32, text_layers=1, text_max_length=12, block_out_channels=(32, 64))

def batch(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {'pixel_values': torch.rand(n, 3, 32, 32, generator=g) * 2 - 1, 'caption': (CORPUS * 2)[:n - 1] + ['']}

def model(**kw): return LatentDiffusion.from_config(LDMConfig.preset('tiny', **{**SMALL, **kw}), corpus=CORPUS)

@pytest.mark.parametrize('pt', ['epsilon', 'v_prediction'])
@pytest.mark.parametrize('vae', ['tiny', 'pixel'])
def test_loss_finite_and_backprops(pt, vae):
    m = model(prediction_type=pt, vae=vae, snr_gamma=5.0, noise_offset=0.1)
    out = m.loss(m.trainable, batch(), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(out['loss']) and torch.isfinite(out['mse'])
    out['loss'].backward()
    assert all(p.grad is not None for p in m.unet.parameters() if p.requires_grad)
    assert not any(p.requires_grad for p in m.text_encoder.parameters())

def test_v_target_matches_scheduler():
    s = build_scheduler(LDMConfig(prediction_type='v_prediction'))
    x, n, t = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8), torch.tensor([5, 300, 900])
    v = diffusion_target(s, x, n, t)
    torch.testing.assert_close(v, s.get_velocity(x, n, t))
    ab = s.alphas_cumprod[t].view(-1, 1, 1, 1)
    torch.testing.assert_close(v, ab.sqrt() * n - (1 - ab).sqrt() * x, rtol=1e-4, atol=1e-5)
    assert diffusion_target(build_scheduler(LDMConfig()), x, n, t) is n

def test_min_snr_changes_weighting():
    t = torch.tensor([1, 100, 500, 999])
    s = build_scheduler(LDMConfig())
    w = loss_weights(s, t, 5.0); snr = compute_snr(s, t)
    torch.testing.assert_close(w, torch.clamp(snr, max=5.0) / snr)
    assert not torch.allclose(w, torch.ones(4)) and torch.equal(loss_weights(s, t), torch.ones(4))
    m, g = model(), lambda: torch.Generator().manual_seed(3)
    plain = m.loss(m.trainable, batch(), generator=g())
    m.snr_gamma = 5.0
    weighted = m.loss(m.trainable, batch(), generator=g())
    torch.testing.assert_close(weighted['mse'], plain['mse'])   # same draw, same MSE
    assert weighted['loss'].item() != pytest.approx(plain['loss'].item())

def test_cond_dropout_in_loss():
    m = model(cond_dropout=1.0)
    g = lambda: torch.Generator().manual_seed(0)
    a = m.loss(m.trainable, batch(), generator=g())['loss']
    b = m.loss(m.trainable, {**batch(), 'caption': [''] * 4}, generator=g())['loss']
    torch.testing.assert_close(a, b)

def test_trainable_text_encoder():
    m = model(train_text_encoder=True)
    m.loss(m.trainable, batch(), generator=torch.Generator().manual_seed(0))['loss'].backward()
    assert m.text_encoder.model.get_input_embeddings().weight.grad is not None
    assert any(p is m.text_encoder.model.get_input_embeddings().weight for p in m.trainable.parameters())

def test_save_load_roundtrip_and_pipeline(tmp_path):
    m = model(prediction_type='v_prediction', snr_gamma=5.0)
    with torch.no_grad():
        for p in m.unet.parameters(): p.add_(0.01 * torch.randn_like(p))   # not the default init
    m.save_pretrained(tmp_path)
    back = LatentDiffusion.from_pretrained(tmp_path)
    assert back.config == m.config and back.snr_gamma == 5.0 and back.prediction_type == 'v_prediction'
    g = lambda: torch.Generator().manual_seed(0)
    torch.testing.assert_close(back.loss(back.trainable, batch(), generator=g())['loss'], m.loss(m.trainable, batch(), generator=g())['loss'], rtol=1e-6, atol=0)  # float32 rounding: weights round-trip exactly, the loss to 1 ulp
    torch.testing.assert_close(back.generate(['a red circle'], num_inference_steps=3), m.generate(['a red circle'], num_inference_steps=3), rtol=0, atol=0)
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path, safety_checker=None, requires_safety_checker=False)
    assert pipe.scheduler.config.prediction_type == 'v_prediction'
    img = pipe("a red circle", num_inference_steps=2, output_type='np', generator=torch.Generator().manual_seed(0)).images
    assert img.shape == (1, 32, 32, 3) and (img >= 0).all() and (img <= 1).all()
    # the pipeline's prompt embedding equals ours
    pe, _ = pipe.encode_prompt("a red circle", 'cpu', 1, False)
    torch.testing.assert_close(pe, m.text_encoder.encode(["a red circle"]))

def test_pixel_roundtrip(tmp_path):
    m = model(vae='pixel')
    m.save_pretrained(tmp_path)
    back = LatentDiffusion.from_pretrained(tmp_path)
    assert back.autoencoder.is_pixel
    g = lambda: torch.Generator().manual_seed(0)
    torch.testing.assert_close(back.loss(back.trainable, batch(), generator=g())['loss'], m.loss(m.trainable, batch(), generator=g())['loss'], rtol=0, atol=0)

def test_errors():
    with pytest.raises(ValueError, match='prediction_type'): LDMConfig(prediction_type='x0')
    m = model()
    with pytest.raises(KeyError, match="caption"): m.loss(m.trainable, {'pixel_values': torch.zeros(1, 3, 32, 32)})

def test_noise_offset_changes_noise():
    m, g = model(), lambda: torch.Generator().manual_seed(0)
    a = m.loss(m.trainable, batch(), generator=g())['mse']
    m.noise_offset = 0.5
    assert m.loss(m.trainable, batch(), generator=g())['mse'].item() != pytest.approx(a.item())
