"Autoencoders: shapes, scaling factor, pixel mode, VAE training task."
import pytest, torch
from diffusers import AutoencoderKL
from imagegen.autoencoders.kl import ImageAutoencoder, VAEConfig, VAETask, latent_std, set_scaling_factor, tiny_vae_config

def images(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.full((n, 3, 32, 32), -0.8)
    for i in range(n):
        a, c = torch.randint(0, 20, (2,), generator=g).tolist()
        x[i, :, a:a+12, c:c+12] = torch.rand(3, 1, 1, generator=g) * 2 - 1
    return x

@pytest.mark.parametrize('n_down,hw', [(2, 16), (3, 8)])
def test_encode_decode_shapes(n_down, hw):
    ae = ImageAutoencoder(AutoencoderKL(**tiny_vae_config(32, n_down, base_channels=16)))
    z = ae.encode(images(2))
    assert z.shape == (2, 4, hw, hw) == (2, *ae.latent_shape(32, 32))
    assert ae.decode(z).shape == (2, 3, 32, 32)

def test_scaling_factor_applied_and_stored(tmp_path):
    vae = AutoencoderKL(**tiny_vae_config(base_channels=16))
    raw = ImageAutoencoder(vae).encode(images(4))
    std = latent_std(vae, [images(8)])
    set_scaling_factor(vae, 1 / std)
    ae = ImageAutoencoder(vae)
    assert ae.scaling_factor == pytest.approx(1 / std)
    torch.testing.assert_close(ae.encode(images(4)), raw / std, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ae.decode(ae.encode(images(2))), vae.decode(vae.encode(images(2)).latent_dist.mode()).sample, rtol=1e-4, atol=1e-4)
    assert 0.6 < ae.encode(images(16), sample=True).std().item() < 1.6
    ae.save_pretrained(tmp_path)
    assert ImageAutoencoder.from_pretrained(tmp_path).scaling_factor == pytest.approx(1 / std)

def test_pixel_mode(tmp_path):
    px = ImageAutoencoder.pixel(); x = images(2)
    assert px.encode(x) is x and px.decode(x) is x and px.scaling_factor == 1.0 and px.latent_shape(32, 32) == (3, 32, 32)
    px.save_pretrained(tmp_path)
    assert ImageAutoencoder.from_pretrained(tmp_path).is_pixel

def test_training_reduces_reconstruction_loss(tmp_path):
    task = VAETask.from_config(VAEConfig(base_channels=16), seed=0)
    opt = torch.optim.Adam(task.trainable.parameters(), lr=2e-3)
    data = images(32)
    with torch.no_grad(): before = task.loss(task.trainable, {'pixel_values': data})['l1'].item()
    for step in range(25):
        out = task.loss(task.trainable, {'pixel_values': data[(step*8) % 32:][:8]})
        opt.zero_grad(); out['loss'].backward(); opt.step()
    with torch.no_grad(): after = task.loss(task.trainable, {'pixel_values': data})['l1'].item()
    assert after < 0.7 * before, (before, after)
    assert task.reconstruct().shape == (16, 3, 32, 32) and [len(x) for x in task.sample(4, 1)] == [8, 8]
    task.save_pretrained(tmp_path)
    assert ImageAutoencoder.from_pretrained(tmp_path).scaling_factor == pytest.approx(1 / task.latent_std())

def test_bad_batch_message():
    with pytest.raises(KeyError, match='pixel_values'): VAETask.from_config(VAEConfig(base_channels=16)).loss(None, {'image': images(1)})
