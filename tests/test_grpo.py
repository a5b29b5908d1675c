"""GRPO of the latent GPT under the shared loop on real processes: 2 gloo CPU ranks launched by `accelerate launch`,
each sampling its own prompts, the weights in sync after every update, only rank 0 writing, the saved model loading
as a `TextToImageGPT`, and a resumed run continuing from its checkpoint. The model is tiny and its reward a toy: the
notebooks show that GRPO raises a reward; these tests check the plumbing."""
import textwrap
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
    "scripts/train_grpo.py under `accelerate launch` on 2 ranks: the run finishes, the grids and the model are written; a latent-diffusion folder is refused in one line."
    import json, sys
    from PIL import Image
    from imagegen.ar.task import TextToImageGPT
    from imagegen.rl.grpo import ShapesPrompts
    from conftest import run, ROOT
    save_tiny_gpt(tmp_path/'gpt', ShapesPrompts()(200, seed=0)[0])
    out = tmp_path/'grpo'
    launch('scripts/train_grpo.py', '--pretrained_model_name_or_path', tmp_path/'gpt', '--output_dir', out,
           '--max_train_steps', 2, '--report_to', 'none', '--prompts_per_step', 1, '--num_generations', 4, '--n_samples', 3)
    info = json.loads((out/'model'/'run_info.json').read_text())
    assert info['step'] == 2 and info['config']['grpo']['group_size'] == 4 and info['config']['model']['reward'] is None
    before, both = Image.open(out/'samples_before.png'), Image.open(out/'before_after.png')
    assert both.height == 2 * before.height
    TextToImageGPT.from_pretrained(out/'model')
    (tmp_path/'ldm').mkdir(); (tmp_path/'ldm'/'model_index.json').write_text('{}')
    p = run([sys.executable, str(ROOT/'scripts'/'train_grpo.py'), '--pretrained_model_name_or_path', str(tmp_path/'ldm'),
             '--output_dir', str(tmp_path/'x'), '--report_to', 'none'], check=False)
    assert p.returncode == 2 and 'latent-diffusion model' in p.stderr and 'Traceback' not in p.stderr, p.stderr
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
