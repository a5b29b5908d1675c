"The README's main job, end to end with tiny step counts: every stage runs and the outputs are where it says."
import json, shutil
from pathlib import Path
import pytest
from conftest import ROOT, run

def test_main_job_tiny(tmp_path):
    out = tmp_path/'main'
    p = run(['make', '-s', 'main', f'MAIN={out}', 'VAE_STEPS=3', 'LDM_STEPS=3', 'N_EVAL=8', 'N_TRAIN=256'], timeout=900)
    assert 'adherence (colour and shape right):' in p.stdout, p.stdout[-3000:]
    m = json.loads((out/'samples'/'metrics.json').read_text())
    assert m['n_images'] == 8 and 0 <= m['oracle/color_and_shape'] <= 1 and m['sampler'] == 'dpmpp_2m'
    assert 'fid' in m and m['fid_features']
    assert m['first_stage/n'] == 8 and 0 <= m['first_stage/color_and_shape'] <= 1  # the VAE's ceiling, from the model's vae/
    assert 'first-stage ceiling' in p.stdout
    assert (out/'samples'/'grid.png').exists() and (out/'ldm'/'model'/'model_index.json').exists()
    assert (out/'ldm'/'run_info.json').exists() and list((out/'ldm'/'logs').rglob('events.out.tfevents*'))
    cfg = json.loads((out/'ldm'/'run_info.json').read_text())['config']      # the recipe of scripts/configs/main_ldm.yaml, steps from LDM_STEPS
    assert cfg['model']['train_text_encoder'] and cfg['model']['pooled_text'] and cfg['data']['cache_latents'] and cfg['model']['snr_gamma'] == 5.0
    assert (cfg['train']['max_steps'], cfg['train']['batch_size'], cfg['train']['ema']) == (3, 64, True)
    assert f"metrics logged to TensorBoard {out/'ldm'/'logs'}" in p.stdout and 'step 3' in p.stdout   # evaluate.py -> the run's curves
    # TASK=edit starts from the text-to-image model just made (not trained again), fine-tunes the editor, scores held-out edits
    t2i_saved = (out/'ldm'/'model'/'unet'/'diffusion_pytorch_model.safetensors').stat().st_mtime_ns
    p = run(['make', '-s', 'main', 'TASK=edit', f'MAIN={out}', 'EDIT_STEPS=3', 'N_EVAL=8', 'N_TRAIN=256'], timeout=900)
    assert f"starting from the text-to-image model in {out/'ldm'/'model'}" in p.stdout
    assert (out/'ldm'/'model'/'unet'/'diffusion_pytorch_model.safetensors').stat().st_mtime_ns == t2i_saved
    assert 'edit accuracy (the change made, nothing else changed):' in p.stdout, p.stdout[-3000:]
    m = json.loads((out/'ldm-edit-samples'/'metrics.json').read_text())
    assert m['n_images'] == 8 and 0 <= m['edit/correct'] <= 1 and m['family'] == 'ldm-edit'
    cfg = json.loads((out/'ldm-edit'/'run_info.json').read_text())['config']   # scripts/configs/main_edit_ldm.yaml, steps from EDIT_STEPS
    assert (cfg['train']['max_steps'], cfg['train']['batch_size'], cfg['model']['pretrained_model_name_or_path']) == (3, 64, str(out/'ldm'/'model'))
    assert cfg['model']['snr_gamma'] is None     # the editor recipe's plain MSE, not the text-to-image model's min-SNR ...
    saved = json.loads((out/'ldm-edit'/'model'/'imagegen_ldm.json').read_text())
    assert saved['snr_gamma'] is None and saved['config']['snr_gamma'] is None   # ... and so the editor it trained
    assert (out/'ldm-edit-samples'/'grid.png').exists()


@pytest.mark.slow   # the latent diffusion main job above stays in the default run
def test_main_job_glide_tiny(tmp_path):
    "make main FAMILY=glide: base model, upsampler on Shapes rendered at 128 px, two-stage sampling, both resolutions evaluated."
    out = tmp_path/'main'
    p = run(['make', '-s', 'main', 'FAMILY=glide', f'MAIN={out}', 'GLIDE_STEPS=3', 'UP_STEPS=3', 'N_EVAL=8', 'N_TRAIN=256',
             'N_UP_TRAIN=32'], timeout=900)
    base = json.loads((out/'glide-samples'/'base'/'metrics.json').read_text())
    up = json.loads((out/'glide-samples'/'metrics.json').read_text())
    assert base['n_images'] == up['n_images'] == 8 and base['family'] == 'glide' and up['upsampler/steps'] == 8
    assert 0 <= base['oracle/color_and_shape'] <= 1 and 0 <= up['oracle/color_and_shape'] <= 1
    assert up['upsampler/resolution'] == 128 and {'upsampler/psnr', 'bicubic/psnr', 'upsampler/ssim', 'bicubic/ssim'} <= set(up)
    from PIL import Image
    assert Image.open(out/'glide-samples'/'base'/'000000.png').size == (32, 32) and Image.open(out/'glide-samples'/'000000.png').size == (128, 128)
    cfg = json.loads((out/'glide_upsampler'/'run_info.json').read_text())['config']   # scripts/configs/main_glide_upsampler.yaml
    assert (cfg['model']['train_crop'], cfg['train']['max_steps']) == (64, 3)
    assert 'upsampler on true 32->128 px renders' in p.stdout


@pytest.mark.slow   # the latent diffusion main job above stays in the default run
def test_main_job_glm_tiny(tmp_path):
    "make main FAMILY=glm: its VAE, then GLM-Image (both stages, first stages fitted and cached) in the release's classes, scored through GlmImagePipeline on held-out prompts and on seen pairs."
    out = tmp_path/'main'
    p = run(['make', '-s', 'main', 'FAMILY=glm', f'MAIN={out}', 'GLM_VAE_STEPS=2', 'GLM_STEPS=2', 'N_EVAL=4', 'N_GLM_TRAIN=64'], timeout=900)
    assert not (out/'shapes').exists()                                   # the 32 px folder of the other families is not written
    for samples in ('glm-samples', 'glm-samples-seen'):
        m = json.loads((out/samples/'metrics.json').read_text())
        assert m['n_images'] == 4 and m['family'] == 'glm' and m['guidance'] == 3 and 0 <= m['oracle/color_and_shape'] <= 1
    cfg = json.loads((out/'glm'/'run_info.json').read_text())['config']   # scripts/configs/main_glm.yaml, steps from GLM_STEPS
    assert (cfg['model']['size'], cfg['model']['train'], cfg['data']['cache_latents'], cfg['train']['max_steps']) == ('shapes', 'both', True, 2)
    from diffusers import GlmImagePipeline
    assert GlmImagePipeline.from_pretrained(out/'glm'/'model').vae.config.latents_std != [1.0] * 4   # the trained VAE, with its statistics
    assert 'adherence (colour and shape right):' in p.stdout


def test_gpu_check_without_a_gpu_says_where_to_run_it(tmp_path):
    "make gpu-check on a machine without nvidia-smi: one line saying to run it on a GPU node, exit 2, nothing run or written; with one, its recipe names the notebooks that hold #| cuda cells."
    if shutil.which('nvidia-smi'): pytest.skip("this machine has nvidia-smi: make gpu-check would run")
    p = run(['make', '-s', 'gpu-check', f'GPU_OUT={tmp_path/"gpu"}'], check=False)
    assert p.returncode == 2 and 'run it on a GPU node' in p.stdout, (p.returncode, p.stdout[-1500:], p.stderr[-1500:])
    assert not (tmp_path/'gpu').exists()
    recipe = run(['make', '-n', 'gpu-check']).stdout
    assert 'nbs/02c_loop.ipynb' in recipe and 'nbs/scripts/45_bench_glm_step.ipynb' in recipe and 'bench_glm_step.py' in recipe
