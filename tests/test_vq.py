"""VQ-VAE first stage: dead-code restart, both VQ sources behind VQTokenizer (ours after save/load, a diffusers VQModel
folder incl. a pipeline subfolder, remap and sane_index_shape), clear errors, float32 quantiser under autocast, resume,
2-rank training with identical replicas and codebooks, and the train_vqvae.py CLI."""
import json, sys
from pathlib import Path
import numpy as np, pytest, torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, VQModel
from diffusers.models.autoencoders.vae import VectorQuantizer
from conftest import ROOT, run, two_ranks
from imagegen.autoencoders.kl import tiny_vae_config
from imagegen.autoencoders.vq import EMAQuantizer, VQConfig, VQTokenizer, VQVAETask, vq_model_config
from imagegen.training.loop import Preempted, TrainConfig, Trainer, train


def images(n, seed=0, size=32):
    "Coloured squares on a dark background in [-1, 1] (a stand-in for Shapes)."
    g = torch.Generator().manual_seed(seed)
    x = torch.full((n, 3, size, size), -0.8)
    for i in range(n):
        a, c = torch.randint(0, size - 12, (2,), generator=g).tolist()
        x[i, :, a:a+12, c:c+12] = torch.rand(3, 1, 1, generator=g) * 2 - 1
    return x


def tiny_cfg(**kw):
    return VQConfig(codebook_size=64, **kw)


def clustered(n=512, dim=4, seed=0):
    "Unit vectors around `dim` orthogonal directions, shaped like encoder outputs (1, dim, h, w)."
    g = torch.Generator().manual_seed(seed)
    z = torch.eye(dim).repeat(n // dim, 1) + 0.3 * torch.randn(n, dim, generator=g)
    return z.T.reshape(1, dim, 16, n // 16).requires_grad_()


# ---- the quantiser ----

def test_dead_code_restart_revives_dead_codes():
    torch.manual_seed(0)
    q, cb = EMAQuantizer(32, 4, usage_window=2).train(), torch.zeros(32, 4)
    q(clustered(), cb)                                          # k-means initialisation from the data
    cb[:16] = -F.normalize(torch.ones(16, 4), dim=-1)           # 16 codes point away from all data ...
    q.embed_sum[:16] = cb[:16]; q.cluster_size[:16] = 0         # ... and have no tokens: dead
    dead_before = cb[:16].clone()
    q_off, cb_off = EMAQuantizer(32, 4, usage_window=2, restart=False).train(), cb.clone()
    q_off.load_state_dict(q.state_dict())
    usage_on, usage_off, revived = [], [], []
    for seed in range(1, 5):
        _, _, _, s = q(clustered(seed=seed), cb); usage_on.append(s['usage'].item()); revived.append(s['restarted'].item())
        _, _, _, s = q_off(clustered(seed=seed), cb_off); usage_off.append(s['usage'].item())
    assert revived[0] == 16, revived
    assert not torch.isclose(cb[:16], dead_before).all(dim=1).any(), "every dead code was replaced"
    data = F.normalize(clustered(seed=4).detach()[0].flatten(1).T, dim=-1)   # (N, 4)
    assert ((cb[:16] @ data.T).max(1).values > 0.5).all(), "revived codes lie among the data"
    assert torch.allclose(cb.norm(dim=-1), torch.ones(32), atol=1e-5)
    assert usage_on[-1] > usage_off[-1] + 0.25, (usage_on, usage_off)
    assert (cb_off[:16] == dead_before).all(1).sum() >= 15, "without restart dead codes stay dead (one may catch an outlier)"


def test_dead_threshold_scales_with_tokens_per_step():
    "The same relative usage is dead or alive whatever the batch size: the threshold is a fraction of the fair share."
    for scale in (1, 8):
        q, cb = EMAQuantizer(8, 4, dead_code_threshold=0.1), F.normalize(torch.randn(8, 4), dim=-1)
        q.cluster_size.copy_(torch.tensor([0.05, 0.09, 0.11, 1, 1, 2, 2, 0.5]) * 8 * scale)   # in units of the fair share
        dead = q.restart_dead(F.normalize(torch.randn(64 * scale, 4), dim=-1), cb, torch.tensor(8. * 8 * scale))
        assert dead.item() == 2 and q.cluster_size[:2].tolist() == [8. * scale] * 2


def test_quantiser_keeps_float32_under_autocast():
    torch.manual_seed(0)
    q, cb, h = EMAQuantizer(256, 8).eval(), F.normalize(torch.randn(256, 8), dim=-1), torch.randn(4, 8, 16, 16)
    ref = q(h, cb)
    with torch.autocast('cpu', dtype=torch.bfloat16): got = q(h, cb)
    assert got[0].dtype == got[1].dtype == torch.float32
    assert torch.equal(got[2], ref[2]), "nearest codes as in float32 (bf16 similarities would flip near ties)"
    task = VQVAETask.from_config(tiny_cfg(), seed=0)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = task.loss(task.trainable, images(4))
    cb, q = task.trainable.codebook, task.trainable.quantizer
    assert cb.dtype == q.embed_sum.dtype == q.cluster_size.dtype == torch.float32 and out['commit'].dtype == torch.float32
    assert torch.allclose(cb.norm(dim=-1), torch.ones(64), atol=1e-5)
    out['loss'].backward()
    assert task.vqmodel.encoder.conv_in.weight.grad is not None and cb.grad is None


def test_gradients_reach_the_encoder_through_both_terms():
    "The commitment term pulls the encoder output (not the codebook); the reconstruction reaches it straight through."
    q, cb = EMAQuantizer(64, 8).eval(), F.normalize(torch.randn(64, 8), dim=-1)
    for term in (1, 0):   # 1: commitment loss, 0: a loss on the quantised output
        h = torch.randn(2, 8, 4, 4, requires_grad=True)
        out = q(h, cb)
        out[term].sum().backward() if term else (out[0] * torch.randn_like(out[0])).sum().backward()
        assert h.grad is not None and h.grad.abs().sum() > 0, f"no gradient from term {term}"


# ---- both VQ sources behind VQTokenizer ----

def test_ours_after_save_and_load(tmp_path):
    task = VQVAETask.from_config(tiny_cfg(), seed=0)
    opt = torch.optim.AdamW([p for p in task.trainable.parameters() if p.requires_grad], lr=2e-3)
    for step in range(10):                                                   # 512 tokens a step for 64 codes: no duplicate codes
        out = task.loss(task.trainable, images(8, seed=step))
        opt.zero_grad(); out['loss'].backward(); opt.step()
    task.save_pretrained(tmp_path/'model')
    tok = VQTokenizer(VQModel.from_pretrained(tmp_path/'model'))             # a plain diffusers load
    assert (tok.vocab_size, tok.downsample_factor, tok.token_grid(32), tok.token_grid(32, 48)) == (64, 4, (8, 8), (8, 12))
    x = images(6, seed=99)
    t = tok.encode(x)
    assert t.shape == (6, 8, 8) and t.dtype == torch.int64 and 0 <= t.min() and t.max() < 64
    task.trainable.eval()
    with torch.no_grad(): rec, _, idx, _ = task.trainable(x)
    assert torch.equal(t, idx), "the saved VQModel tokenises as the training-time quantiser"
    y = tok.decode(t)
    assert y.shape == (6, 3, 32, 32) and y.dtype == torch.float32
    torch.testing.assert_close(y, rec, rtol=1e-4, atol=1e-4)
    assert torch.equal(VQTokenizer.from_pretrained(tmp_path/'model').encode(x), t)
    tok.save_pretrained(tmp_path/'again')
    assert torch.equal(VQTokenizer.from_pretrained(tmp_path/'again').decode(t), y)


def legacy_vqmodel(seed=0, **kw):
    torch.manual_seed(seed)
    return VQModel(**vq_model_config(codebook_size=48, code_dim=3, **kw)).eval()   # diffusers' init: not unit norm


def test_pretrained_diffusers_folder_and_pipeline_subfolder(tmp_path):
    vq = legacy_vqmodel()
    vq.save_pretrained(tmp_path/'plain')
    vq.save_pretrained(tmp_path/'pipe'/'vqvae')
    (tmp_path/'pipe'/'model_index.json').write_text(json.dumps({'_class_name': 'LDMPipeline', 'vqvae': ['diffusers', 'VQModel']}))
    x = images(4)
    with torch.no_grad():
        h = vq.encode(x).latents
        expect_idx = torch.cdist(h.permute(0, 2, 3, 1).reshape(-1, 3), vq.quantize.embedding.weight).argmin(-1).view(4, 8, 8)
        expect_img = vq.decode(h).sample                                     # diffusers' own quantise + decode
    for tok in (VQTokenizer.from_pretrained(tmp_path/'plain'), VQTokenizer.from_pretrained(tmp_path/'pipe', subfolder='vqvae')):
        assert tok.vocab_size == 48 and tok.code_dim == 3
        t = tok.encode(x)
        assert torch.equal(t, expect_idx)
        torch.testing.assert_close(tok.decode(t), expect_img, rtol=1e-5, atol=1e-5)


def test_legacy_quantizer_options_respected(tmp_path):
    "sane_index_shape gives the same ids; remap maps ids to the used subset on encode and back on decode."
    vq, x = legacy_vqmodel(), images(3)
    tok = VQTokenizer(vq)
    plain, img = tok.encode(x), tok.decode(tok.encode(x))
    vq.quantize.sane_index_shape = True
    assert torch.equal(tok.encode(x), plain)
    used = np.random.default_rng(0).permutation(48)                          # every code used, in another order
    np.save(tmp_path/'used.npy', used)
    q = VectorQuantizer(48, 3, beta=0.25, remap=str(tmp_path/'used.npy'), sane_index_shape=False)
    q.embedding.weight.data.copy_(vq.quantize.embedding.weight.data)
    vq.quantize = q
    remapped = tok.encode(x)
    assert tok.vocab_size == 48 and torch.equal(torch.from_numpy(used)[remapped], plain)
    torch.testing.assert_close(tok.decode(remapped), img)


# ---- clear errors ----

def test_bad_tokens_and_images():
    tok = VQTokenizer(legacy_vqmodel())
    with pytest.raises(ValueError, match=r'token id 48 is out of range.*vocabulary of 48 codes'): tok.decode(torch.full((1, 8, 8), 48))
    with pytest.raises(ValueError, match=r'token id -1 is out of range'): tok.decode(-torch.ones(1, 8, 8, dtype=torch.long))
    with pytest.raises(TypeError, match='integer token ids'): tok.decode(torch.zeros(1, 8, 8))
    with pytest.raises(ValueError, match=r'\(B, h, w\)'): tok.decode(torch.zeros(64, dtype=torch.long))
    with pytest.raises(ValueError, match='not divisible by .* downsampling factor 4'): tok.encode(torch.zeros(1, 3, 30, 32))
    with pytest.raises(ValueError, match='1 channels'): tok.encode(torch.zeros(1, 1, 32, 32))


def test_other_family_refused(tmp_path):
    AutoencoderKL(**tiny_vae_config(base_channels=16)).save_pretrained(tmp_path/'kl')
    with pytest.raises(ValueError, match=r"class 'AutoencoderKL', not 'VQModel'.*ImageAutoencoder"):
        VQTokenizer.from_pretrained(tmp_path/'kl')
    # an LDM folder: a pipeline whose vae/ is a KL autoencoder
    AutoencoderKL(**tiny_vae_config(base_channels=16)).save_pretrained(tmp_path/'ldm'/'vae')
    (tmp_path/'ldm'/'model_index.json').write_text('{}')
    with pytest.raises(FileNotFoundError, match='holds a pipeline'): VQTokenizer.from_pretrained(tmp_path/'ldm')
    with pytest.raises(ValueError, match='AutoencoderKL'): VQTokenizer.from_pretrained(tmp_path/'ldm', subfolder='vae')
    legacy_vqmodel().save_pretrained(tmp_path/'run'/'model')
    with pytest.raises(FileNotFoundError, match="subfolder='model'"): VQTokenizer.from_pretrained(tmp_path/'run')
    with pytest.raises(TypeError, match='AutoencoderKL'): VQTokenizer(AutoencoderKL(**tiny_vae_config(base_channels=16)))


# ---- the shared loop: resume, two ranks, CLI ----

class StopAt(VQVAETask):
    "Asks the trainer to stop (as SIGUSR1 would) when it reaches step `at`."
    def loss(self, model, batch):
        if getattr(self, 'trainer', None) and self.trainer.step == self.at: self.trainer.request_stop()
        return super().loss(model, batch)


class Images(torch.utils.data.Dataset):
    def __init__(self, n, seed=0): self.x = images(n, seed)
    def __len__(self): return len(self.x)
    def __getitem__(self, i): return {'pixel_values': self.x[i]}


def loader(n=48, seed=0):
    return torch.utils.data.DataLoader(Images(n, seed), batch_size=8, shuffle=True, drop_last=True)


def quantiser_state(task) -> dict:
    return {k: v.clone() for k, v in task.trainable.state_dict().items() if k.startswith('quantizer.') or 'quantize.' in k}


def test_resume_continues_the_codebook(tmp_path):
    "Stopped at step 3 and resumed, the codebook and its EMA statistics end as in an uninterrupted 6-step run."
    cfg = lambda d: TrainConfig(output_dir=str(d), max_steps=6, lr=2e-3, tracker='none', checkpoint_every=None, log_every=1)
    full = VQVAETask.from_config(tiny_cfg(dead_code_threshold=0.5), seed=0)
    train(full, loader(), cfg(tmp_path/'a'))
    first = StopAt.from_config(tiny_cfg(dead_code_threshold=0.5), seed=0); first.at = 2   # stops after update 3
    first.trainer = Trainer(first, loader(), cfg(tmp_path/'b'))
    with pytest.raises(Preempted): first.trainer.fit()
    assert quantiser_state(first)['quantizer.steps'].item() == 3
    rest = VQVAETask.from_config(tiny_cfg(dead_code_threshold=0.5), seed=1)   # other weights: all must come from the checkpoint
    res = train(rest, loader(), cfg(tmp_path/'b'))
    assert res['resumed_from'].endswith('step_00000003')
    a, b = quantiser_state(full), quantiser_state(rest)
    assert a.keys() == b.keys() and {'quantizer.cluster_size', 'quantizer.embed_sum', 'quantizer.usage_counts'} <= a.keys()
    for k in a: torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
    assert a['quantizer.steps'].item() == 6


def _two_rank_vq(out):
    "Worker: 4 steps on 2 ranks (different images on each), dead codes forced every step; writes what each rank holds."
    from accelerate import PartialState
    task = VQVAETask.from_config(tiny_cfg(dead_code_threshold=0.9), seed=0)
    restarted, loss = [], task.loss
    def recording_loss(model, batch):
        out = loss(model, batch); restarted.append(out['restarted'].item()); return out
    task.loss = recording_loss
    c = TrainConfig(output_dir=out, max_steps=4, lr=2e-3, tracker='none', checkpoint_every=None, log_every=1, grad_accum=2)
    res = train(task, loader(n=64), c)
    state = {k: v.detach().clone() for k, v in task.trainable.state_dict().items()}
    torch.save({'state': state, 'restarted': restarted, 'logs': res['last_logs'], 'keys': len(state)},
               Path(out)/f'rank{PartialState().process_index}.pt')


def test_two_ranks_identical_replicas_and_codebooks(tmp_path):
    two_ranks(__file__, '_two_rank_vq', tmp_path, timeout=180)
    r0, r1 = (torch.load(tmp_path/f'rank{i}.pt') for i in (0, 1))
    assert sum(r0['restarted']) > 0 and r0['restarted'] == r1['restarted'], "restarts happened, the same on both ranks"
    for k, v in r0['state'].items():
        torch.testing.assert_close(r1['state'][k], v, rtol=0, atol=0, msg=f"{k} differs between ranks")
    start = VQVAETask.from_config(tiny_cfg(), seed=0).trainable.state_dict()
    assert not torch.equal(start['vqmodel.encoder.conv_in.weight'], r0['state']['vqmodel.encoder.conv_in.weight'])
    assert r0['state']['quantizer.steps'].item() == 8, "4 updates of 2 accumulated batches"
    assert r0['logs']['usage'] == r1['logs']['usage'] and r0['logs']['perplexity'] == r1['logs']['perplexity']


def test_train_vqvae_cli(tmp_path):
    out = tmp_path/'run'
    run([sys.executable, 'scripts/train_vqvae.py', '--output_dir', str(out), '--max_train_steps', '3', '--train_batch_size', '4',
         '--dataset', 'shapes:n=16', '--report_to', 'none', '--codebook_size', '64', '--code_dim', '4'])
    vq = VQModel.from_pretrained(out/'model')
    assert (vq.config.num_vq_embeddings, vq.config.vq_embed_dim) == (64, 4)
    assert torch.allclose(vq.quantize.embedding.weight.norm(dim=-1), torch.ones(64), atol=1e-4), "codes trained by our quantiser"
    info = json.loads((out/'model'/'run_info.json').read_text())['config']
    assert info['train']['experiment'] == 'vqvae-training' and info['train']['tags']['model'] == 'vqvae'
    assert VQTokenizer.from_pretrained(out/'model').encode(images(2)).shape == (2, 8, 8)
