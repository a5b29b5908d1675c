"""GRPO of GLM-Image (the real `GlmImagePipeline` classes, tiny and built here) under the shared loop on real processes:
2 gloo CPU ranks launched by `accelerate launch`, each on its own rollout, against 1 rank on both rollouts; and
`scripts/train_grpo.py` on a GLM-Image folder, whose LoRA result loads with diffusers' own LoRA loading and draws the
images our sampler draws, and its checkpoint exports to the same model. The rewards are toys: `nbs/06h_glm_grpo.ipynb` checks the ratio and the stages; these tests
check the plumbing."""
import json, textwrap
import pytest
import torch
from conftest import BIN, ROOT, launch, rank_records, run

GLM_GRPO = textwrap.dedent('''
    "GRPO of both stages of a tiny GLM-Image on fixed rollouts; argv: OUTPUT_DIR MODE (split: rollout r on rank r; joint: both on one rank)."
    import json, os, sys, torch
    from imagegen.glm.build import build_glm_image
    from imagegen.glm.task import GlmConfig, GlmImage
    from imagegen.rl.glm import GlmGRPO
    from imagegen.rl.grpo import GRPOConfig, ShapesPrompts
    from imagegen.rl.rewards import Reward
    from imagegen.training.loop import TrainConfig, train
    class Brightness(Reward):
        name = 'brightness'
        def score(self, images, prompts=None, **_): return [sum(im.convert('L').getdata()) / (255 * im.width * im.height) for im in images]
    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ.get('RANK', 0))

    def cat(key, a, b):
        "Two rollout batches as one: rows concatenated; the supports padded to one width; the schedule and settings shared."
        if isinstance(a, dict): return {k: cat(k, a[k], b[k]) for k in a}
        if key in ('timesteps', 'sigmas', 'temperature') or a is None: return a
        if key == 'codes': return [torch.cat([x, y]) for x, y in zip(a, b)]
        if key in ('support', 'support_mask'):
            K = max(a.shape[-1], b.shape[-1])
            pad = lambda t: torch.nn.functional.pad(t, (0, K - t.shape[-1]), value=0 if key == 'support' else False)
            return torch.cat([pad(a), pad(b)])
        if torch.is_tensor(a): return torch.cat([a, b]) if a.ndim else a
        return a + b if isinstance(a, list) else a

    class Recorded(GlmGRPO):
        "Rollouts of seeds 100 and 101 (one prompt, 2 token grids, 2 decodes each): rank r trains on rollout r, or one rank on both."
        seen = []
        def batches(self, accelerator):
            with self.full_policy(): groups = [self.rollout(100), self.rollout(101)]   # FSDP2: whole weights for the rollouts
            batch = groups[rank] if mode == 'split' else {k: cat(k, groups[0][k], groups[1][k]) for k in groups[0]}
            for _ in range(self.inner_steps): yield batch
        def configure_optimizer(self, model, cfg):      # plain SGD: the update is the gradient, so averaged ranks compare exactly
            return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
        def loss(self, model, batch):
            o = super().loss(model, batch)
            self.seen.append([o[f'{s}/ratio_{m}'].item() for s in ('ar', 'dit') for m in ('min', 'max')] + [batch['caption']])
            return o
    glm = GlmImage(build_glm_image('tiny', seed=0), GlmConfig(train='both', resolution=64))
    task = Recorded(glm, Brightness(), ShapesPrompts(), grpo=GRPOConfig(group_size=2), prompts_per_step=1, decoder_group_size=2,
                    num_inference_steps=4, train_steps=2, inner_steps=2)
    train(task, None, TrainConfig(output_dir=out, max_steps=2, lr=0.1, tracker='none', checkpoint_every=None, save_model=True,
                                  max_grad_norm=None))
    with open(f'{out}/seen_rank{rank}.json', 'w') as f: json.dump(task.seen, f)
''')


def _seen(folder):
    return {r: json.loads((folder/f'seen_rank{r}.json').read_text()) for r in (0, 1)}


flat = lambda mod: torch.cat([p.detach().flatten() for p in mod.parameters()])
STAGES = (('ar', lambda p: p.vision_language_encoder.model.language_model), ('dit', lambda p: p.transformer))


def test_glm_grpo_both_stages_two_ranks_match_one_rank(tmp_path):
    "GLM-Image GRPO of both stages on 2 ranks: ratio exactly 1 for the generator and the DiT at each rollout's first update on each rank, and both stages end at the weights one rank reaches on both rollouts."
    from diffusers import GlmImagePipeline
    from imagegen.glm.build import build_glm_image
    (tmp_path/'ggrpo.py').write_text(GLM_GRPO)
    launch(tmp_path/'ggrpo.py', tmp_path/'split', 'split')
    launch(tmp_path/'ggrpo.py', tmp_path/'joint', 'joint', num_processes=1)
    seen = _seen(tmp_path/'split')
    for r in (0, 1):
        first, second = seen[r]
        assert first[:4] == [1.0] * 4, f"rank {r}: the first update of its rollout had ratio ranges {first[:4]} (ar min/max, dit min/max)"
        assert second[:2] != [1.0, 1.0] and second[2:4] != [1.0, 1.0], f"rank {r}: the second update did not move both ratios: {second[:4]}"
    assert seen[0][0][4] != seen[1][0][4], "both ranks trained on the same rollout"
    start = build_glm_image('tiny', seed=0)
    a, b = (GlmImagePipeline.from_pretrained(tmp_path/m/'model') for m in ('split', 'joint'))
    for stage, get in STAGES:
        moved = (flat(get(a)) - flat(get(start))).abs().max().item()
        assert moved > 1e-4, f"GRPO barely changed the {stage} stage ({moved})"
        # 2 % of the move: the rows of one batch and of two batches round differently (and the joint batch pads its prompts);
        # unsynchronised ranks miss by about the move itself
        gap = (flat(get(a)) - flat(get(b))).abs().max().item()
        assert gap < 0.02 * moved, f"{stage}: 2 ranks end {gap:.3g} away from 1 rank on both rollouts (the stage moved {moved:.3g})"
    assert torch.equal(flat(a.vision_language_encoder.model.visual), flat(start.vision_language_encoder.model.visual)), "the vision tower is frozen"


@pytest.mark.slow
def test_glm_grpo_both_stages_under_fsdp_match_ddp(tmp_path):
    "The same two-rank GRPO of both stages under FSDP2: each rank's ratios and both stages' weights are DDP's (measured: equal; 1e-6 allows reduce-scatter's rounding). Slow: a second variant of the test above, run with `--slow`."
    from diffusers import GlmImagePipeline
    from test_fsdp import two_stage_grpo_under_fsdp_and_ddp
    two_stage_grpo_under_fsdp_and_ddp(tmp_path, GLM_GRPO, GlmImagePipeline.from_pretrained, [get for _, get in STAGES], tol=1e-6)


def test_train_grpo_script_dit_lora_image_to_image(tmp_path):
    "train_grpo.py on a GLM-Image folder: the DiT alone with LoRA, image to image on Shapes edits with SSIM to the target; the result's adapters load with diffusers' `load_lora_adapter` into the base `GlmImagePipeline`, whose images are our sampler's; a hybrid-only option and a t2i/i2i mix-up are refused in one line."
    from diffusers import GlmImagePipeline
    from imagegen.glm.build import build_glm_image, fix_image_to_image
    from imagegen.glm.task import DIT_LORA_DIR, GlmConfig, GlmImage
    from imagegen.rl.grpo import ShapesEditPrompts
    from imagegen.glm.sft import _pil
    base = tmp_path/'base'
    GlmImage(build_glm_image('tiny', seed=0), GlmConfig(resolution=64)).save_pretrained(base)
    args = [str(BIN/'python'), 'scripts/train_grpo.py', '--pretrained_model_name_or_path', str(base), '--train', 'dit', '--mode', 'i2i',
            '--reward_dit', 'ssim', '--lora_rank', '4', '--num_generations', '2', '--prompts_per_step', '1', '--num_inference_steps', '4',
            '--train_steps', '2', '--max_steps', '2', '--learning_rate', '1e-2', '--report_to', 'none', '--n_samples', '2',
            '--checkpointing_steps', '2', '--output_dir', str(tmp_path/'run')]
    p = run(args, timeout=900)
    assert 'dit/reward' in p.stdout or 'reward/' in p.stdout, p.stdout[-2000:]
    out = tmp_path/'run'/'model'
    assert (out/DIT_LORA_DIR).is_dir() and (tmp_path/'run'/'before_after.png').is_file()
    ours = GlmImage.from_pretrained(out)
    prompts, ctx = ShapesEditPrompts('test', resolution=64)(2, seed=7)
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(2)]
    mine = ours.generate(prompts, ctx['sources'], generator=gens(), num_inference_steps=4)
    pipe = fix_image_to_image(GlmImagePipeline.from_pretrained(base))   # diffusers' base and its LoRA loader (the fix: transformers 5.23's i2i)
    pipe.transformer.load_lora_adapter(str(out/DIT_LORA_DIR), prefix=None, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    theirs = torch.cat([pipe(prompt=[pr], image=[[_pil(s)]], height=64, width=64, num_inference_steps=4, guidance_scale=ours.sampling['guidance_scale'],
                             generator=g, output_type='pt').images for pr, s, g in zip(prompts, ctx['sources'], gens())]) * 2 - 1
    assert (mine - theirs).abs().max() < 1e-4, (mine - theirs).abs().max()
    plain = GlmImage.from_pretrained(base).generate(prompts, ctx['sources'], generator=gens(), num_inference_steps=4)
    assert (mine - plain).abs().max() > 1e-3, "the adapters changed nothing: GRPO did not train them (or they were not loaded)"
    # the step-2 checkpoint exported by export_checkpoint.py (the run's policy rebuilt from its initial model) is the final model
    run([str(BIN/'python'), 'scripts/export_checkpoint.py', '--run', str(tmp_path/'run'), '--step', '2', '--ema', 'false',
         '--output_dir', str(tmp_path/'export')], timeout=300)
    again = GlmImage.from_pretrained(tmp_path/'export').generate(prompts, ctx['sources'], generator=gens(), num_inference_steps=4)
    assert torch.equal(again, mine), (again - mine).abs().max()
    for extra, says in ((['--decoder_guidance_scale', '2'], 'decoder_guidance_scale'), (['--train', 'decoder', '--mode', 'x2y'], "mode='x2y'")):
        bad = run(args[:-2] + ['--output_dir', str(tmp_path/'bad')] + extra, check=False, timeout=300)
        assert bad.returncode != 0 and says in bad.stderr and 'Traceback' not in bad.stderr, bad.stderr[-1500:]


def test_train_grpo_script_bf16_keeps_frozen_weights_in_bf16(tmp_path):
    """train_grpo.py on a GLM-Image folder under --mixed_precision bf16, the generator with LoRA: the folder loads in bf16 and its
    frozen weights stay so (the release's 17.7B: 33 GiB, not 66), the adapters train in float32, and the run ends with a model."""
    from imagegen.glm.build import build_glm_image
    from imagegen.glm.task import AR_LORA_DIR, GlmConfig, GlmImage
    base = tmp_path/'base'
    GlmImage(build_glm_image('tiny', seed=0), GlmConfig(resolution=64)).save_pretrained(base)
    launch('scripts/train_grpo.py', '--pretrained_model_name_or_path', base, '--train', 'ar', '--lora_rank', 4, '--num_generations', 2,
           '--prompts_per_step', 1, '--num_inference_steps', 3, '--max_steps', 2, '--learning_rate', '1e-2', '--report_to', 'none',
           '--mixed_precision', 'bf16', '--output_dir', tmp_path/'run', num_processes=1, probe=tmp_path/'probe')
    rec = rank_records(tmp_path/'probe', 1)[0]
    assert (rec['frozen_dtypes'], rec['param_dtypes']) == (['torch.bfloat16'], ['torch.float32']), (rec['frozen_dtypes'], rec['param_dtypes'])
    assert not torch.equal(rec['params_start'], rec['params'])
    assert (tmp_path/'run'/'model'/AR_LORA_DIR).is_dir()
