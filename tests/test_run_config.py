"A run's configuration from a YAML file plus flags, the example configs, and fine-tuning a Stable-Diffusion folder."
import importlib.util, json, re, sys
from pathlib import Path

import pytest, torch, yaml

from conftest import ROOT, run


def script(name):
    "A training script as a module (its DEFAULTS, FLAGS, main)."
    spec = importlib.util.spec_from_file_location(name, ROOT/'scripts'/f'{name}.py')
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod


def resolve(name, argv, stage=None):
    "The run a training script would get from `argv` (train_glide.py: its `stage`'s defaults, 'base' unless given)."
    from imagegen.config import parse_run
    m = script(name)
    return parse_run(m.DEFAULTS[stage or 'base'] if name == 'train_glide' else m.DEFAULTS, m.FLAGS, argv)


def test_yaml_plus_flags_resolve_in_documented_order(tmp_path):
    "script defaults < section preset < YAML file < command line"
    f = tmp_path/'run.yaml'
    f.write_text(yaml.safe_dump({'train': {'preset': 'tiny', 'max_steps': 50, 'lr': 1e-3},
                                 'model': {'preset': 'small', 'snr_gamma': 5},
                                 'data': {'dataset': 'shapes:n=16', 'random_flip': True}}))
    run_ = resolve('train_ldm', ['--config', str(f), '--learning_rate', '2e-3', '--use_ema', '--tags', 'phase=a,res=64',
                                 '--validation_prompts', 'a red circle', 'a blue square, left', '--random_flip', 'false'])
    t, m, d = run_['train'], run_['model'], run_['data']
    assert (t.lr, t.max_steps, t.ema, t.batch_size) == (2e-3, 50, True, 4)      # flag > file > preset ('tiny': batch 4) > script default (32)
    assert t.ema_decay == 0.999 and t.tags == {'phase': 'a', 'res': '64'}         # a script default the file does not touch
    assert t.validation_prompts == ['a red circle', 'a blue square, left']        # commas inside a prompt survive
    assert (m.resolution, m.block_out_channels, m.snr_gamma) == (64, (128, 256, 256), 5.0)   # 'small' preset + file
    assert (d.dataset, d.random_flip, d.caption_dropout) == ('shapes:n=16', False, 0.1)
    # the dotted form reaches every field, and the run file `config.yaml` (what a run writes) reads back the same
    assert resolve('train_ldm', ['--model.attention_head_dim', '4'])['model'].attention_head_dim == 4
    again = tmp_path/'config.yaml'
    again.write_text(yaml.safe_dump({k: c.to_dict() for k, c in run_.items()}))
    assert resolve('train_ldm', ['--config', str(again)]) == run_


@pytest.mark.parametrize('bad, expect', [
    ({'model': {'snr_gama': 5}}, "unknown field 'snr_gama' of LDMConfig (did you mean 'snr_gamma'?)"),
    ({'trian': {'lr': 1e-3}}, "unknown section 'trian' (did you mean 'train'?)"),
    ({'train': {'lr': 'fast'}}, "TrainConfig.lr: expected float, got 'fast'"),
])
def test_typo_in_yaml_is_a_clear_error_before_anything_runs(tmp_path, bad, expect):
    f = tmp_path/'bad.yaml'
    f.write_text(yaml.safe_dump(bad))
    p = run([sys.executable, 'scripts/train_ldm.py', '--config', str(f), '--output_dir', str(tmp_path/'out')], check=False)
    assert p.returncode == 2 and expect in p.stderr and str(f) in p.stderr, p.stderr[-2000:]
    assert 'Traceback' not in p.stderr and not (tmp_path/'out').exists()


def test_unknown_flag_is_refused():
    p = run([sys.executable, 'scripts/train_vae.py', '--learnig_rate', '1e-3'], check=False)
    assert p.returncode == 2 and 'unrecognized arguments: --learnig_rate' in p.stderr


@pytest.mark.parametrize('path', sorted((ROOT/'scripts'/'configs').glob('*.yaml')), ids=lambda p: p.name)
def test_example_configs_resolve(path):
    "Each example config is read by the script its name ends with (GLIDE's upsampler recipe: train_glide.py --stage upsample; editor recipes `*_edit_<family>`: train_edit.py; `grpo_*`: train_grpo.py; `*_glm`: train_glm_image.py), without error."
    stage = 'upsample' if path.stem.endswith('glide_upsampler') else None
    grpo = path.stem.startswith('grpo_')
    glm = path.stem.endswith('_glm')
    edit = '_edit_' in path.stem and not grpo and not glm
    name = 'train_grpo' if grpo else 'train_glide' if stage else 'train_glm_image' if glm else 'train_edit' if edit else 'train_' + path.stem.rsplit('_', 1)[1]
    run_ = resolve(name, ['--config', str(path)], stage)
    assert set(run_) == ({'train', 'model', 'grpo'} if grpo else {'train', 'model', 'data'})
    if path.stem == 'main_edit_glm':   # GLM-Image's edit recipe (make main TASK=edit FAMILY=glm): both stages image to image on Shapes edits
        m, t = run_['model'], run_['train']
        assert (m.mode, m.train, m.resolution, run_['data'].dataset, m.pretrained_model_name_or_path) == ('i2i', 'both', 64, 'shapes', None)
        assert (t.max_steps, t.batch_size, t.lr, t.ema) == (2000, 16, 5e-4, True)
    if path.stem == 'grpo_hybrid_ar_shapes':   # the hybrid's AR-stage recipe (nbs/experiments): the GPT alone, the oracle on set A's 128 px images
        m, t = run_['model'], run_['train']
        assert (m.stage, m.reward, m.decoder_group_size, m.num_inference_steps, m.prompt_split, m.prompt_pairs) == (
            'ar', {'oracle': 1.0}, 1, 8, 'test', ['red triangle', 'blue circle', 'magenta triangle'])
        assert (t.max_steps, t.lr, run_['grpo'].group_size, run_['grpo'].kl_coef, m.prompts_per_step, m.inner_steps) == (200, 3e-5, 8, 0.04, 4, 2)
    elif path.stem == 'grpo_hybrid_both_shapes':   # the joint recipe (nbs/experiments): both stages, each its own reward and rate
        m, t = run_['model'], run_['train']
        assert (m.stage, m.reward, m.decoder_reward, m.decoder_group_size, m.num_inference_steps, m.train_steps) == (
            'both', {'oracle': 1.0}, {'ssim': 1.0, 'oracle': 0.5}, 2, 8, 2)
        assert (m.prompt_split, m.prompt_pairs, m.prompts_per_step, m.inner_steps) == ('test', ['red triangle', 'blue circle', 'magenta triangle'], 2, 2)
        assert (t.max_steps, t.lr, round(t.lr * m.decoder_lr_scale, 9), run_['grpo'].group_size, run_['grpo'].kl_coef) == (100, 3e-5, 1e-5, 8, 0.04)
    elif path.stem == 'grpo_hybrid_decoder_shapes':   # the measured hybrid recipe (nbs/experiments): the decoder alone, fidelity to the layout
        m, t = run_['model'], run_['train']
        assert (m.stage, m.decoder_reward, m.decoder_group_size, m.num_inference_steps, m.train_steps) == ('decoder', {'ssim': 1.0, 'oracle': 0.5}, 4, 8, None)
        assert (t.max_steps, t.lr, run_['grpo'].group_size, run_['grpo'].kl_coef, m.prompts_per_step, m.inner_steps) == (50, 1e-5, 2, 0.04, 2, 2)
    elif grpo and path.stem.endswith('_relation'):   # the measured relation recipes (nbs/experiments): two-object prompts of the training split only
        m, ldm = run_['model'], path.stem.startswith('grpo_ldm')
        assert (m.prompt_split, m.prompt_level, m.prompt_pairs, m.reward) == ('train', 2, None, {'oracle': 1.0})
        assert (run_['train'].max_steps, run_['grpo'].group_size, run_['grpo'].kl_coef, run_['train'].lr) == (200, 8, 0.04, 1e-5 if ldm else 3e-5)
    elif path.stem.endswith('_heldout_pairs'):   # the held-out-pair recipes (nbs/experiments): test-split two-object prompts, the evaluation's own excluded
        m, ldm = run_['model'], path.stem.startswith('grpo_ldm')
        assert (m.prompt_split, m.prompt_level, m.prompt_pairs, m.reward, m.prompt_exclude) == (
            'test', 2, None, {'oracle': 1.0}, f"runs/main/{'samples' if ldm else 'gpt-samples'}-level2/samples.jsonl")
        assert (run_['train'].max_steps, run_['train'].lr, run_['grpo'].group_size, run_['grpo'].kl_coef, m.inner_steps) == (
            (200, 1e-5, 8, 0.04, 2) if ldm else (800, 3e-5, 8, 0.04, 2))
        if ldm: assert (m.num_inference_steps, m.train_steps, m.guidance_scale, m.lora_rank) == (10, 5, 4.0, None)
    elif path.stem == 'grpo_ldm_order':   # the measured order recipe (nbs/experiments/06_grpo_relations, "A validation reward and the best model")
        m, t, g = run_['model'], run_['train'], run_['grpo']
        assert (m.prompt_split, m.prompt_level, m.prompt_relations, m.reward, m.prompt_exclude) == (
            'test', 2, ['left of', 'right of'], {'oracle': 1.0, 'relation': 1.0}, 'runs/main/samples-level2/samples.jsonl')
        assert (m.num_inference_steps, m.train_steps, m.untrained_eta, m.train_text_encoder, m.guidance_scale, m.prompts_per_step, m.inner_steps) == (
            10, 2, 0.0, True, 4.0, 2, 2)
        assert (t.max_steps, t.lr, g.group_size, g.kl_coef, m.num_validation_prompts, t.eval_steps, t.eval_on_start, t.metric_for_best_model) == (
            500, 3e-5, 16, 0.1, 64, 25, True, 'reward_mean')
    elif path.stem.startswith('grpo_glm_'):   # GLM-Image's stage recipes: one stage each, training prompts, the oracle, guidance 3 as make main samples
        m, t = run_['model'], run_['train']
        which, i2i = path.stem.split('_')[2], '_edit_' in path.stem   # the edit recipe: image to image, SSIM to the target render
        assert (m.stage, m.mode, m.reward, m.prompt_split, m.guidance_scale, m.num_inference_steps) == (
            which, 'i2i' if i2i else 't2i', {'ssim': 1.0} if i2i else {'oracle': 1.0}, 'train', 3.0, 10)
        assert (t.max_steps, t.lr, run_['grpo'].group_size, m.train_steps) == (100, 1e-4 if which == 'dit' else 3e-5, 8, None if which == 'ar' else 3)
        if which == 'both':   # each grid decoded twice; the DiT at the DiT-only recipe's 1e-4
            assert (m.decoder_reward, m.decoder_group_size, round(t.lr * m.decoder_lr_scale, 6)) == ({'oracle': 1.0}, 2, 1e-4)
    elif grpo and path.stem.endswith('_ocr'):   # the OCR recipe: the text variant's training pairs, Tesseract's reading as reward
        m = run_['model']
        assert (m.prompts, m.prompt_split, m.reward, m.num_inference_steps, m.train_steps) == ('shapes-text', 'train', {'ocr': 1.0}, 10, 5)
        assert (run_['train'].max_steps, run_['train'].lr, run_['grpo'].group_size, run_['grpo'].kl_coef) == (150, 3e-5, 8, 0.04)
    elif grpo:   # the measured recipes (nbs/experiments): 200 steps on three of the held-out pairs, 8 samples per prompt; the GPT's without a KL term
        m, ldm = run_['model'], path.stem.startswith('grpo_ldm')
        assert type(m).__name__ == 'GRPORunConfig' and run_['train'].max_steps == 200 and run_['grpo'].group_size == 8
        assert (m.prompt_split, m.prompt_pairs) == ('test', ['red triangle', 'blue circle', 'magenta triangle'])
        assert m.reward == ({'oracle': 1.0, 'ssim': 0.5} if '_edit_' in path.stem else {'oracle': 1.0})
        assert (run_['grpo'].kl_coef, run_['train'].lr) == ((0.04, 1e-5) if ldm else (0.0, 3e-5))
        if ldm: assert (m.num_inference_steps, m.train_steps, m.guidance_scale, m.lora_rank) == (10, 5, 4.0, None)
    if edit: assert type(run_['model']).__name__ == 'EditConfig' and type(run_['data']).__name__ == 'EditDataConfig'
    if path.stem == 'main_edit_ldm': assert run_['model'].source_lr_scale == 10   # the measured recipe (nbs/experiments)
    if path.stem == 'main_edit_gpt': assert (run_['model'].token_noise, run_['train'].max_steps) == (0.95, 3000)   # the measured recipe (nbs/experiments)
    if stage:   # the measured upsampler recipe (nbs/experiments): 64 px crops, the condition skip, little augmentation, none at sampling
        m = run_['model']
        assert type(m).__name__ == 'UpsamplerConfig' and (m.train_crop, m.condition_skip_std, m.condition_skip_flat_std, m.condition_realign,
                                                            m.condition_skip_scale_output, m.noise_aug_max, m.noise_level,
                                                            run_['train'].max_steps) == (64, 0.05, 0.01, True, True, 50, 0, 800)
    if path.stem == 'main_gpt':   # the measured recipe (nbs/experiments): a text model without layers, 4800 steps, token noise 0.4, the codebook head
        m = run_['model']
        assert (m.text_layers, m.train_text_encoder, m.token_noise, m.guidance_scale, m.temperature, m.output_head,
                run_['train'].max_steps) == (0, True, 0.4, 1.5, 0.7, 'codebook', 4800)
    if path.stem == 'main_glide':   # the measured base recipe (nbs/experiments): text-only attention, heads of 8 channels, schedule shifted by 3, no text layer
        m = run_['model']
        assert (m.attention_head_dim, m.only_cross_attention, m.pooled_text, m.prediction_type, m.schedule_shift, m.text_layers, run_['train'].max_steps) == (8, True, True, 'v_prediction', 3.0, 0, 1300)


def test_main_job_config_is_the_main_recipe():
    "scripts/configs/main_ldm.yaml is the recipe `make main` measured (nbs/experiments): guard it against silent edits."
    r = resolve('train_ldm', ['--config', str(ROOT/'scripts'/'configs'/'main_ldm.yaml')])
    t, m, d = r['train'], r['model'], r['data']
    assert (t.max_steps, t.batch_size, t.lr, t.warmup_steps, t.ema, t.ema_decay, t.lr_scheduler) == (3500, 64, 5e-4, 100, True, 0.999, 'constant_with_warmup')
    assert (m.train_text_encoder, m.pooled_text, m.resolution, m.snr_gamma) == (True, True, 32, 5.0)   # min-SNR: held over four seeds (nbs/experiments)
    assert (d.cache_latents, d.caption_dropout, d.latent_mode, d.cache_text_embeddings) == (True, 0.1, False, False)   # its text encoder trains
    assert 'main_vae.yaml' in (ROOT/'Makefile').read_text() and 'main_ldm.yaml' in (ROOT/'Makefile').read_text()


def main_command(tmp_path, *needles, args=()):
    "The first line of `make -n main MAIN=tmp_path ARGS` that holds every needle."
    p = run(['make', '-n', '-s', 'main', f'MAIN={tmp_path}', *args])
    return next(l for l in p.stdout.splitlines() if all(n in l for n in needles))


def test_main_first_stage_data_follows_the_task(tmp_path):
    "`make main` trains the text-to-image first stage (VAE or VQ-VAE) on the single-object folder and the TASK=edit one on one- and two-object scenes (the editors add and remove a second object: nbs/experiments)."
    for family, script in (('ldm', 'scripts/train_vae.py'), ('gpt', 'scripts/train_vqvae.py')):
        command = lambda *args: main_command(tmp_path, script, args=(f'FAMILY={family}', *args))
        assert f'--train_data_dir {tmp_path}/shapes/imagefolder/train' in command() and 'level=mixed' not in command()
        assert '--dataset_name shapes:level=mixed' in command('TASK=edit') and '--train_data_dir' not in command('TASK=edit')


def test_main_glm_edit_fine_tunes_the_text_to_image_model_image_to_image(tmp_path):
    "`make main FAMILY=glm TASK=edit`: its VAE on one- and two-object scenes, then the text-to-image GLM-Image fine-tuned image to image with its recipe, and the held-out edits sampled and scored through the pipeline."
    args = ('FAMILY=glm', 'TASK=edit')
    assert 'level=mixed' in main_command(tmp_path, 'scripts/train_vae.py', args=args) and 'level=mixed' not in main_command(tmp_path, 'scripts/train_vae.py', args=('FAMILY=glm',))
    assert f'--pretrained_model_name_or_path {tmp_path}/glm/model' in main_command(tmp_path, 'train_glm_image.py', 'main_edit_glm.yaml', args=args)
    assert f'--out {tmp_path}/glm-edit-samples' in main_command(tmp_path, 'scripts/sample.py', '--shapes_edit_split test', args=args)
    assert main_command(tmp_path, 'scripts/evaluate.py', 'glm-edit-samples', args=args)
    p = run(['make', '-s', 'main', f'MAIN={tmp_path}', 'FAMILY=glide', 'TASK=edit'], check=False)
    assert p.returncode != 0 and 'edit with FAMILY=ldm, gpt or glm' in p.stdout + p.stderr


def test_main_level_mixed_trains_on_two_objects_and_scores_relations(tmp_path):
    "`make main LEVEL=mixed` writes one- and two-object training scenes for every stage and scores the text-to-image model on held-out two-object prompts too, with the family's own sampling settings; LEVEL=1 does neither."
    assert '--level 1 ' in main_command(tmp_path, 'scripts/make_shapes.py') and '--shapes_level 2' not in run(['make', '-n', '-s', 'main', f'MAIN={tmp_path}']).stdout
    for family, samples, args in (('ldm', 'samples', '--sampler dpmpp_2m --steps 20 --guidance 4'), ('gpt', 'gpt-samples', ''),
                                  ('glide', 'glide-samples', '--sampler dpmpp_2m --steps 20 --guidance 3')):
        command = lambda *needles: main_command(tmp_path, *needles, args=(f'FAMILY={family}', 'LEVEL=mixed'))
        assert '--level mixed ' in command('scripts/make_shapes.py', f'{tmp_path}/shapes ')
        level2 = command('scripts/sample.py', '--shapes_level 2')
        assert f'--out {tmp_path}/{samples}-level2' in level2 and args in level2 and '--upsampler' not in level2
        assert command('scripts/evaluate.py', f'{samples}-level2')
    # the GPT's codebook head gets its free rows at LEVEL=mixed only (nbs/experiments: two-object scenes)
    assert '--head_free_rows true' in main_command(tmp_path, 'scripts/train_gpt.py', args=('FAMILY=gpt', 'LEVEL=mixed'))
    assert '--head_free_rows' not in main_command(tmp_path, 'scripts/train_gpt.py', args=('FAMILY=gpt',))
    # latent diffusion trains twice the recipe's steps at LEVEL=mixed (3500 do not teach left/right: nbs/experiments); LDM_STEPS still wins
    assert '--max_train_steps 7000' in main_command(tmp_path, 'scripts/train_ldm.py', args=('LEVEL=mixed',))
    assert '--max_train_steps' not in main_command(tmp_path, 'scripts/train_ldm.py')
    assert '--max_train_steps 60' in main_command(tmp_path, 'scripts/train_ldm.py', args=('LEVEL=mixed', 'LDM_STEPS=60'))
    # and sees every scene mirrored too (its left/right: nbs/experiments/06_grpo_relations.ipynb, "Mirrored scenes teach left and right"); level 1 as before
    assert '--random_flip true' in main_command(tmp_path, 'scripts/train_ldm.py', args=('LEVEL=mixed',))
    assert '--random_flip' not in main_command(tmp_path, 'scripts/train_ldm.py')
    p = run(['make', '-s', 'main', f'MAIN={tmp_path}', 'LEVEL=2'], check=False)
    assert p.returncode != 0 and 'LEVEL is 1, or mixed' in p.stdout + p.stderr
    # GLM-Image draws its scenes itself (no folder): both its VAE and its two stages on mixed scenes, the level-2 prompts
    # sampled as make main samples the held-out ones
    glm = lambda *needles, level='mixed': main_command(tmp_path, *needles, args=('FAMILY=glm', f'LEVEL={level}'))
    for script in ('scripts/train_vae.py', 'scripts/train_glm_image.py'):
        assert '--dataset_name shapes:n=4000,level=mixed ' in glm(script) and 'level=mixed' not in glm(script, level=1)
    level2 = glm('scripts/sample.py', '--shapes_level 2')
    assert f'--model {tmp_path}/glm/model' in level2 and '--guidance 3 --batch_size 50' in level2 and f'--out {tmp_path}/glm-samples-level2' in level2
    assert glm('scripts/evaluate.py', 'glm-samples-level2')


def test_main_edit_samples_at_each_familys_image_guidance(tmp_path):
    "`make main TASK=edit` samples the held-out edits at the family's image guidance from the Makefile (not InstructPix2Pix's default 1.5; the choice: nbs/experiments), and EDIT_IMAGE_GUIDANCE_<family> overrides it."
    edit_sample_command = lambda *args: main_command(tmp_path, 'scripts/sample.py', '--shapes_edit_split', args=('TASK=edit', *args))
    mk = (ROOT/'Makefile').read_text()
    for family in ('ldm', 'gpt'):
        ig = re.search(rf'^EDIT_IMAGE_GUIDANCE_{family} \?= (\S+)$', mk, re.M).group(1)
        assert f'--image_guidance {ig} ' in edit_sample_command(f'FAMILY={family}')
        assert '--image_guidance 2.5 ' in edit_sample_command(f'FAMILY={family}', f'EDIT_IMAGE_GUIDANCE_{family}=2.5')


def test_finetune_a_local_stable_diffusion_folder(tmp_path):
    "--pretrained_model_name_or_path on a diffusers-made SD folder: its VAE, tokenizer, text encoder and UNet are loaded, the UNet trains, the result loads in StableDiffusionPipeline."
    from diffusers import StableDiffusionPipeline
    from imagegen.diffusion.sampling import tiny_sd_components
    sd = tmp_path/'tiny-sd'
    StableDiffusionPipeline(**tiny_sd_components(seed=0), safety_checker=None, feature_extractor=None,
                            requires_safety_checker=False).save_pretrained(sd)
    out = tmp_path/'run'
    run([sys.executable, 'scripts/train_ldm.py', '--pretrained_model_name_or_path', str(sd), '--resolution', '32',
         '--train_data_dir', 'shapes:n=16', '--max_train_steps', '2', '--train_batch_size', '4', '--learning_rate', '1e-3',
         '--report_to', 'none', '--output_dir', str(out)])
    before = StableDiffusionPipeline.from_pretrained(sd, safety_checker=None)
    after = StableDiffusionPipeline.from_pretrained(out/'model', safety_checker=None)
    changed = lambda a, b: any(not torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert changed(before.unet, after.unet)
    assert not changed(before.vae, after.vae) and not changed(before.text_encoder, after.text_encoder)
    assert after.tokenizer.get_vocab() == before.tokenizer.get_vocab()
    assert type(after.scheduler).__name__ == 'DPMSolverMultistepScheduler'
    info = json.loads((out/'model'/'run_info.json').read_text())
    assert info['config']['model']['pretrained_model_name_or_path'] == str(sd)
    img = after('a red circle', num_inference_steps=2, output_type='np').images
    assert img.shape == (1, 32, 32, 3)
