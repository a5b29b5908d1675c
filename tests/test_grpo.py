"""GRPO of both families under the shared loop on real processes: 2 gloo CPU ranks launched by `accelerate launch`,
each sampling its own prompts, the weights in sync after every update, only rank 0 writing, the saved model loading
in its family's class, a resumed run continuing from its checkpoint, the ratio exactly 1 at the first update of every
rollout on every rank, and a 2-rank step on two groups equal to a 1-rank step on the same two groups. The models are
tiny and their rewards toys: the notebooks show that GRPO raises a reward; these tests check the plumbing."""
import textwrap
import pytest
from conftest import launch, rank_records

GRPO_TRAIN = textwrap.dedent('''
    "GRPO fine-tuning of a tiny latent GPT with the shared loop; argv: OUTPUT_DIR MAX_STEPS."
    import sys, torch
    from diffusers import VQModel
    from imagegen.ar.task import GPTConfig, TextToImageGPT
    from imagegen.autoencoders.vq import VQTokenizer
    from imagegen.rl.gpt import GPTGRPO
    from imagegen.rl.grpo import GRPOConfig, ShapesPrompts
    from imagegen.rl.rewards import Reward
    from imagegen.training.loop import TrainConfig, train
    class ShareOfToken0(Reward):
        name, needs = 'token0', ('tokens',)
        def score(self, images, prompts, tokens=None, **_): return (tokens == 0).float().mean(1)
    torch.manual_seed(0)
    vq = VQTokenizer(VQModel(block_out_channels=(16, 32, 32), down_block_types=('DownEncoderBlock2D',) * 3,
                             up_block_types=('UpDecoderBlock2D',) * 3, latent_channels=8, vq_embed_dim=8, num_vq_embeddings=16,
                             norm_num_groups=8, sample_size=32))
    cfg = GPTConfig.preset('tiny', n_layer=1, n_embd=32, n_head=2, text_hidden=32, text_layers=1, text_max_length=24,
                           vqvae='(in memory)', guidance_scale=2.0, temperature=1.0)
    model = TextToImageGPT.from_config(cfg, corpus=ShapesPrompts()(200, seed=0)[0], tokenizer=vq)
    task = GPTGRPO(model, ShareOfToken0(), ShapesPrompts(), GRPOConfig(group_size=4), prompts_per_step=2, inner_steps=2)
    train(task, None, TrainConfig(output_dir=sys.argv[1], max_steps=int(sys.argv[2]), lr=3e-3, tracker='tensorboard',
                                  checkpoint_every=2, save_model=True))
''')


def test_gpt_grpo_two_ranks_and_resume(tmp_path):
    import torch
    from imagegen.ar.task import TextToImageGPT
    (tmp_path/'grpo_train.py').write_text(GRPO_TRAIN)
    out = tmp_path/'run'
    launch(tmp_path/'grpo_train.py', out, 4, probe=tmp_path/'probe')
    r0, r1 = rank_records(tmp_path/'probe', 2)
    assert (r0['world_size'], r0['end_step']) == (2, 4)
    assert not torch.equal(r0['params_start'], r0['params']), "GRPO did not change the transformer"
    torch.testing.assert_close(r0['params'], r1['params'], rtol=0, atol=0)          # in sync after every update
    caps = [[b['captions'] for b in r['batches']] for r in (r0, r1)]
    assert len(caps[0]) == 4 and caps[0][0] == caps[0][1] and caps[0][0] != caps[0][2]   # one rollout per 2 inner steps
    assert caps[0] != caps[1], "both ranks sampled the same prompts"
    assert [p for _, p in r1['writes'] if not p.endswith('random_states_1.pkl')] == [], f"rank 1 wrote {r1['writes']}"
    saved = TextToImageGPT.from_pretrained(out/'model')
    torch.testing.assert_close(torch.cat([p.detach().flatten() for p in saved.gpt.parameters()]), r0['params'], rtol=0, atol=0)
    launch(tmp_path/'grpo_train.py', out, 6, probe=tmp_path/'again')                  # resumed: steps 4 and 5
    a0, _ = rank_records(tmp_path/'again', 2)
    assert a0['start_step'] == 4 and a0['resumed_from'].endswith('step_00000004') and a0['end_step'] == 6
    torch.testing.assert_close(a0['params_start'], r0['params'], rtol=0, atol=0)


def save_tiny_gpt(path, corpus):
    "A tiny untrained latent GPT (random 16-code VQ-VAE) saved at `path` as train_gpt.py saves one."
    import torch
    from diffusers import VQModel
    from imagegen.ar.task import GPTConfig, TextToImageGPT
    from imagegen.autoencoders.vq import VQTokenizer
    torch.manual_seed(0)
    vq = VQTokenizer(VQModel(block_out_channels=(16, 32, 32), down_block_types=('DownEncoderBlock2D',) * 3,
                             up_block_types=('UpDecoderBlock2D',) * 3, latent_channels=8, vq_embed_dim=8, num_vq_embeddings=16,
                             norm_num_groups=8, sample_size=32))
    cfg = GPTConfig.preset('tiny', n_layer=1, n_embd=32, n_head=2, text_hidden=32, text_layers=1, vqvae='(in memory)', temperature=1.0)
    TextToImageGPT.from_config(cfg, corpus=corpus, tokenizer=vq).save_pretrained(path)


def test_train_grpo_script_two_ranks_and_bad_checkpoint(tmp_path):
    "scripts/train_grpo.py under `accelerate launch` on 2 ranks: the run finishes, the grids and the model are written; a GLIDE folder is refused in one line."
    import json, sys
    from PIL import Image
    from imagegen.ar.task import TextToImageGPT
    from imagegen.rl.grpo import ShapesPrompts
    from conftest import run, ROOT
    save_tiny_gpt(tmp_path/'gpt', ShapesPrompts()(200, seed=0)[0])
    out = tmp_path/'grpo'
    p = launch('scripts/train_grpo.py', '--pretrained_model_name_or_path', tmp_path/'gpt', '--output_dir', out,
               '--max_train_steps', 2, '--report_to', 'none', '--prompts_per_step', 1, '--num_generations', 4, '--n_samples', 3,
               '--num_validation_prompts', 3, '--eval_steps', 1, '--eval_on_start', 'true', '--metric_for_best_model', 'reward_mean')
    info = json.loads((out/'model'/'run_info.json').read_text())
    assert info['step'] == 2 and info['config']['grpo']['group_size'] == 4 and info['config']['model']['reward'] is None
    # evaluated on the main rank, the scores shared: one best_model, recorded with its step and score, loadable
    best = json.loads((out/'best_model'/'run_info.json').read_text())['best']
    assert best['metric'] == 'reward_mean' and best['step'] in (0, 1, 2), best
    assert 'step 0: eval reward_mean' in p.stdout + p.stderr, p.stdout[-2000:]   # --eval_on_start: the starting model scored too
    assert f"best validation reward_mean: {best['value']:.4f} at step {best['step']}" in p.stdout, p.stdout[-2000:]
    assert sorted(q.name for q in out.iterdir() if 'best' in q.name) == ['best_model']
    TextToImageGPT.from_pretrained(out/'best_model')
    before, both = Image.open(out/'samples_before.png'), Image.open(out/'before_after.png')
    assert both.height == 2 * before.height
    TextToImageGPT.from_pretrained(out/'model')
    (tmp_path/'glide').mkdir(); (tmp_path/'glide'/'imagegen_glide.json').write_text('{}')
    p = run([sys.executable, str(ROOT/'scripts'/'train_grpo.py'), '--pretrained_model_name_or_path', str(tmp_path/'glide'),
             '--output_dir', str(tmp_path/'x'), '--report_to', 'none'], check=False)
    assert p.returncode == 2 and 'GLIDE model' in p.stderr and 'Traceback' not in p.stderr, p.stderr
    assert not (tmp_path/'x').exists()


def test_train_grpo_ocr_reward_on_text_prompts(tmp_path):
    "`--prompts shapes-text --reward ocr=1`: the rollouts are read by the real Tesseract and the OCR reward is logged."
    import json, shutil, sys
    import pytest
    if not shutil.which('tesseract'): pytest.skip("no tesseract program (Debian tesseract-ocr; make test installs it)")
    from imagegen.rl.grpo import ShapesTextPrompts
    from conftest import run, ROOT
    save_tiny_gpt(tmp_path/'gpt', ShapesTextPrompts()(100, seed=0)[0])
    out = tmp_path/'grpo'
    run([sys.executable, str(ROOT/'scripts'/'train_grpo.py'), '--pretrained_model_name_or_path', str(tmp_path/'gpt'),
         '--output_dir', str(out), '--prompts', 'shapes-text', '--reward', 'ocr=1', '--max_train_steps', '1',
         '--report_to', 'tensorboard', '--log_every', '1', '--prompts_per_step', '1', '--num_generations', '2', '--n_samples', '2'])
    info = json.loads((out/'model'/'run_info.json').read_text())['config']
    assert info['model']['prompts'] == 'shapes-text' and info['model']['reward'] == {'ocr': 1.0}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ev = EventAccumulator(str(next((out/'logs').iterdir()))); ev.Reload()
    vals = [e.value for e in ev.Scalars('reward/ocr')]
    assert len(vals) == 1 and 0.0 <= vals[0] <= 1.0                # an untrained model draws no word: a low but real score


DIFFUSION_GRPO = textwrap.dedent('''
    "GRPO of a tiny latent diffusion model on fixed rollouts; argv: OUTPUT_DIR MODE (split: group r on rank r; joint: both groups on one rank) [text: train the text encoder too]."
    import json, os, sys, torch
    from imagegen.diffusion.ldm import LatentDiffusion, LDMConfig
    from imagegen.rl.diffusion import DiffusionGRPO
    from imagegen.rl.grpo import GRPOConfig, ShapesPrompts
    from imagegen.rl.rewards import Reward
    from imagegen.training.loop import TrainConfig, train
    class Brightness(Reward):
        name = 'brightness'
        def score(self, images, prompts=None, **_): return [sum(im.convert('L').getdata()) / (255 * im.width * im.height) for im in images]
    out, mode, text = sys.argv[1], sys.argv[2], sys.argv[3:] == ['text']
    torch.manual_seed(0)
    model = LatentDiffusion.from_config(LDMConfig.preset('tiny', text_hidden=32, text_layers=1, text_max_length=24),
                                        corpus=ShapesPrompts()(200, seed=0)[0])
    rank = int(os.environ.get('RANK', 0))
    class Recorded(DiffusionGRPO):
        "Rollouts of seeds 100 and 101 (one prompt of 4 samples each): rank r trains on group r, or one rank on both; every loss's ratio range is kept."
        seen = []
        def batches(self, accelerator):
            with self.full_policy(): groups = [self.rollout(100), self.rollout(101)]   # FSDP2: whole weights for the rollouts
            if mode == 'split': batch = groups[rank]
            else: batch = {k: torch.cat([g[k] for g in groups]) if torch.is_tensor(groups[0][k]) else
                              groups[0][k] + groups[1][k] if isinstance(groups[0][k], list) else groups[0][k] for k in groups[0]}
            for _ in range(self.inner_steps): yield batch
        def configure_optimizer(self, model, cfg):      # plain SGD: the update is the gradient, so averaged ranks compare exactly
            return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
        def loss(self, model, batch):
            o = super().loss(model, batch)
            self.seen.append((o['ratio_min'].item(), o['ratio_max'].item(), batch['caption']))
            return o
    task = Recorded(model, Brightness(), ShapesPrompts(), GRPOConfig(group_size=4), prompts_per_step=1, num_inference_steps=4,
                    train_steps=2, inner_steps=2, train_text_encoder=text)
    train(task, None, TrainConfig(output_dir=out, max_steps=2, lr=0.1, tracker='none', checkpoint_every=None, save_model=True,
                                  max_grad_norm=None))
    with open(f'{out}/seen_rank{rank}.json', 'w') as f: json.dump(task.seen, f)
''')


@pytest.mark.parametrize('text', [False, pytest.param(True, marks=pytest.mark.slow)], ids=['unet', 'unet+text_encoder'])
def test_diffusion_grpo_two_ranks_match_one_rank(tmp_path, text):
    "Latent diffusion GRPO on 2 ranks (the UNet, or the UNet and its text encoder): the first update of a rollout has ratio exactly 1 on each rank, and two updates on group r per rank end at the weights one rank reaches on both groups."
    import json, torch
    from imagegen.diffusion.ldm import LatentDiffusion, LDMConfig
    from imagegen.rl.grpo import ShapesPrompts
    (tmp_path/'dgrpo.py').write_text(DIFFUSION_GRPO)
    extra = ['text'] if text else []
    launch(tmp_path/'dgrpo.py', tmp_path/'split', 'split', *extra)
    launch(tmp_path/'dgrpo.py', tmp_path/'joint', 'joint', *extra, num_processes=1)
    seen = {r: json.loads((tmp_path/'split'/f'seen_rank{r}.json').read_text()) for r in (0, 1)}
    for r in (0, 1):
        (lo, hi, caps), (lo2, hi2, _) = seen[r]
        assert (lo, hi) == (1.0, 1.0), f"rank {r}: the first update of its rollout had ratio range {(lo, hi)}"
        assert (lo2, hi2) != (1.0, 1.0), f"rank {r}: the second update did not move the ratio"
    assert seen[0][0][2] != seen[1][0][2], "both ranks trained on the same group"
    joint = json.loads((tmp_path/'joint'/'seen_rank0.json').read_text())
    # the joint run scores both groups in one batch of 8, where the rollouts scored them in batches of 4: exact 1.0 there
    # would ask convolutions to round alike at both batch sizes, which they do not with one thread, so within rounding
    assert joint[0][2] == seen[0][0][2] + seen[1][0][2] and all(abs(x - 1.0) < 1e-5 for x in joint[0][:2]), joint[0][:2]
    flat = lambda u: torch.cat([p.detach().flatten() for p in u.parameters()])
    torch.manual_seed(0)                                                         # the starting model, as the script builds it
    start = LatentDiffusion.from_config(LDMConfig.preset('tiny', text_hidden=32, text_layers=1, text_max_length=24),
                                        corpus=ShapesPrompts()(200, seed=0)[0])
    split, joint = (LatentDiffusion.from_pretrained(tmp_path/m/'model') for m in ('split', 'joint'))
    parts = {'UNet': lambda m: m.unet} | ({'text encoder': lambda m: m.text_encoder.model} if text else {})
    for name, part in parts.items():
        a, b = flat(part(split)), flat(part(joint))
        moved = (a - flat(part(start))).abs().max().item()
        assert moved > 1e-4, f"GRPO barely changed the {name} ({moved})"
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3 * moved, msg=lambda m: f"{name}: {m}")
    if not text: torch.testing.assert_close(flat(split.text_encoder.model), flat(start.text_encoder.model), rtol=0, atol=0)


TINY_HYBRID = '''
def tiny_hybrid(seed=0):
    "A tiny untrained hybrid pipeline: a 2-layer latent GPT over a random 16-code VQ-VAE (32 px) and a 32 -> 64 px GLIDE upsampler."
    import torch
    from diffusers import VQModel
    from imagegen.hybrid import HybridPipeline
    from imagegen.ar.task import GPTConfig, TextToImageGPT
    from imagegen.autoencoders.vq import VQTokenizer
    from imagegen.diffusion.upsampler import GlideUpsampler, UpsamplerConfig
    from imagegen.rl.grpo import ShapesPrompts
    corpus = ShapesPrompts()(200, seed=0)[0]
    torch.manual_seed(seed)
    vq = VQTokenizer(VQModel(block_out_channels=(16, 32, 32), down_block_types=('DownEncoderBlock2D',) * 3,
                             up_block_types=('UpDecoderBlock2D',) * 3, latent_channels=8, vq_embed_dim=8, num_vq_embeddings=16,
                             norm_num_groups=8, sample_size=32))
    ar = TextToImageGPT.from_config(GPTConfig.preset('tiny', n_layer=2, n_embd=64, n_head=4, text_hidden=32, text_layers=1,
                                                     text_max_length=24, vqvae='(in memory)', guidance_scale=3.0, temperature=1.0),
                                    corpus=corpus, tokenizer=vq)
    dec = GlideUpsampler.from_config(UpsamplerConfig(resolution=64, low_res=32, block_out_channels=(32, 32),
                                                     attention_levels=(False, True), text_width=32, text_ctx=24), corpus=corpus)
    return HybridPipeline(ar, dec)
'''

HYBRID_GRPO = TINY_HYBRID + textwrap.dedent('''
    "GRPO of both stages of a tiny hybrid pipeline on fixed rollouts; argv: OUTPUT_DIR MODE (split: group r on rank r; joint: both on one rank)."
    import json, os, sys, torch
    from imagegen.rl.hybrid import HybridGRPO
    from imagegen.rl.grpo import GRPOConfig, ShapesPrompts
    from imagegen.rl.rewards import Reward
    from imagegen.training.loop import TrainConfig, train
    class ShareOfToken0(Reward):
        name, needs = 'token0', ('tokens',)
        def score(self, images, prompts, tokens=None, **_): return (tokens == 0).float().mean(1)
    class Brightness(Reward):
        name = 'brightness'
        def score(self, images, prompts=None, **_): return [sum(im.convert('L').getdata()) / (255 * im.width * im.height) for im in images]
    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ.get('RANK', 0))
    class Recorded(HybridGRPO):
        "Rollouts of seeds 100 and 101 (one prompt, 4 layouts, 2 decodes each): rank r trains on rollout r, or one rank on both."
        seen = []
        def batches(self, accelerator):
            with self.full_policy(): groups = [self.rollout(100), self.rollout(101)]   # FSDP2: whole weights for the rollouts
            if mode == 'split': batch = groups[rank]
            else: batch = {k: torch.cat([g[k] for g in groups]) if torch.is_tensor(groups[0][k]) else
                              groups[0][k] + groups[1][k] if isinstance(groups[0][k], list) else groups[0][k] for k in groups[0]}
            for _ in range(self.inner_steps): yield batch
        def configure_optimizer(self, model, cfg):      # plain SGD: the update is the gradient, so averaged ranks compare exactly
            return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
        def loss(self, model, batch):
            o = super().loss(model, batch)
            self.seen.append([o[f'{s}/ratio_{m}'].item() for s in ('ar', 'decoder') for m in ('min', 'max')] + [batch['caption']])
            return o
    task = Recorded(tiny_hybrid(), ShareOfToken0(), ShapesPrompts(), Brightness(), stage='both', grpo=GRPOConfig(group_size=4),
                    prompts_per_step=1, decoder_group_size=2, decoder_steps=4, decoder_train_steps=2, inner_steps=2)
    train(task, None, TrainConfig(output_dir=out, max_steps=2, lr=0.1, tracker='none', checkpoint_every=None, save_model=True,
                                  max_grad_norm=None))
    with open(f'{out}/seen_rank{rank}.json', 'w') as f: json.dump(task.seen, f)
''')


def test_hybrid_grpo_both_stages_two_ranks_match_one_rank(tmp_path):
    "Hybrid GRPO of both stages on 2 ranks: ratio exactly 1 for both stages at each rollout's first update on each rank, and both stages end at the weights one rank reaches on both rollouts (gradients synchronised through the one wrapper)."
    import json, torch
    from imagegen.hybrid import HybridPipeline
    (tmp_path/'hgrpo.py').write_text(HYBRID_GRPO)
    launch(tmp_path/'hgrpo.py', tmp_path/'split', 'split')
    launch(tmp_path/'hgrpo.py', tmp_path/'joint', 'joint', num_processes=1)
    seen = {r: json.loads((tmp_path/'split'/f'seen_rank{r}.json').read_text()) for r in (0, 1)}
    for r in (0, 1):
        first, second = seen[r]
        assert first[:4] == [1.0] * 4, f"rank {r}: the first update of its rollout had ratio ranges {first[:4]} (ar min/max, decoder min/max)"
        assert second[:2] != [1.0, 1.0] and second[2:4] != [1.0, 1.0], f"rank {r}: the second update did not move both ratios: {second[:4]}"
    assert seen[0][0][4] != seen[1][0][4], "both ranks trained on the same rollout"
    exec(TINY_HYBRID, ns := {})
    start = ns['tiny_hybrid']()
    a, b = (HybridPipeline.from_pretrained(tmp_path/m/'model') for m in ('split', 'joint'))
    flat = lambda mod: torch.cat([p.detach().flatten() for p in mod.parameters()])
    for stage in ('ar', 'decoder'):
        get = (lambda p: p.ar.gpt) if stage == 'ar' else (lambda p: p.decoder.unet)
        moved = (flat(get(a)) - flat(get(start))).abs().max().item()
        assert moved > 1e-4, f"GRPO barely changed the {stage} stage ({moved})"
        # a tolerance of 2 % of the move: a decode pair's advantages are +1 and -1, so its gradients nearly cancel and the sum
        # keeps float32 rounding of the larger terms (batches of 8 and 16 round differently); unsynchronised ranks miss by ~the move
        gap = (flat(get(a)) - flat(get(b))).abs().max().item()
        assert gap < 0.02 * moved, f"{stage}: 2 ranks end {gap:.3g} away from 1 rank on both rollouts (the stage moved {moved:.3g})"



@pytest.mark.slow
def test_hybrid_grpo_under_fsdp_matches_ddp(tmp_path):
    "The same two-rank hybrid GRPO under FSDP2: each rank's ratio ranges and both stages' weights are DDP's to 1e-5. Slow: a second variant of the test above."
    from imagegen.hybrid import HybridPipeline
    from test_fsdp import two_stage_grpo_under_fsdp_and_ddp
    two_stage_grpo_under_fsdp_and_ddp(tmp_path, HYBRID_GRPO, HybridPipeline.from_pretrained, [lambda p: p.ar.gpt, lambda p: p.decoder.unet], tol=1e-5)


def test_sample_script_on_a_hybrid_folder(tmp_path):
    "sample.py --model HYBRID: the GPT's images in OUT/base at its resolution, the decoder's in OUT at the full one; --upsampler is refused in one line."
    import json, sys
    from PIL import Image
    from conftest import run, ROOT
    exec(TINY_HYBRID, ns := {})
    ns['tiny_hybrid']().save_pretrained(tmp_path/'hybrid')
    out = tmp_path/'samples'
    run([sys.executable, str(ROOT/'scripts'/'sample.py'), '--model', str(tmp_path/'hybrid'), '--shapes_split', 'test', '--n', '3',
         '--upsampler_steps', '4', '--out', str(out)])
    rows = [json.loads(l) for l in (out/'samples.jsonl').read_text().splitlines()]
    assert len(rows) == 3 and rows[0]['family'] == 'hybrid' and rows[0]['upsampler_steps'] == 4
    assert Image.open(out/'000000.png').size == (64, 64) and Image.open(out/'base'/'000000.png').size == (32, 32)
    p = run([sys.executable, str(ROOT/'scripts'/'sample.py'), '--model', str(tmp_path/'hybrid'), '--prompts', 'a red circle',
             '--upsampler', str(tmp_path/'hybrid'/'decoder'), '--out', str(tmp_path/'x')], check=False)
    assert p.returncode == 2 and 'hybrid pipeline' in p.stderr and 'Traceback' not in p.stderr, p.stderr
