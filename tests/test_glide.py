"""The GLIDE family through its real scripts: train_glide.py (base and upsampler) on 2 gloo CPU ranks (replicas, text
transformer and tokenizer identical), the saved folders in diffusers' IF pipelines, sample.py with the upsampler on 2
ranks in prompt order, evaluate.py on both resolutions, torch.compile off unless the launcher asks, and the errors a
user meets."""
import json, os, subprocess, sys
from pathlib import Path
import pytest, torch
from conftest import assert_same_image, ROOT, run, launch, rank_records

SMALL = ['--block_out_channels', '32,32', '--attention_levels', 'false,true', '--text_width', 32, '--text_ctx', 16, '--text_layers', 1]
BASE_ARGS = ['--dataset', 'shapes:n=32', '--resolution', 16, '--max_steps', 4, '--batch_size', 4, '--checkpoint_every', 2,
             '--report_to', 'none', *SMALL]
UP_ARGS = ['--stage', 'upsample', '--dataset', 'shapes:n=32', '--resolution', 32, '--low_res', 16, '--max_steps', 2, '--batch_size', 2,
           '--report_to', 'none', '--condition_skip_std', 0.05, '--prediction_type', 'v_prediction', *SMALL]   # the main recipe's UNet


@pytest.fixture(scope='module')
def glide2(tmp_path_factory):
    "scripts/train_glide.py --stage base on 2 ranks, 4 steps; and a 2-step upsampler from one process."
    d = tmp_path_factory.mktemp('glide2')
    launch('scripts/train_glide.py', '--output_dir', d/'run', *BASE_ARGS, probe=d/'probe')
    run([sys.executable, 'scripts/train_glide.py', '--output_dir', str(d/'up'), *map(str, UP_ARGS)])
    return d, rank_records(d/'probe', 2)


def test_two_ranks_stay_identical(glide2):
    d, (r0, r1) = glide2
    assert (r0['world_size'], r1['world_size'], r0['end_step']) == (2, 2, 4)
    assert not torch.equal(r0['params_start'], r0['params']), "training did not change the model"
    torch.testing.assert_close(r0['params'], r1['params'], rtol=0, atol=0)
    torch.testing.assert_close(r0['text_params'], r1['text_params'], rtol=0, atol=0)
    assert r0['vocab'] == r1['vocab']
    info = json.loads((d/'run'/'model'/'run_info.json').read_text())
    assert (info['config']['model']['uncond_p'], info['config']['train']['ema']) == (0.2, True)


def test_folders_load_in_the_if_pipelines(glide2):
    import imagegen.diffusion.glide, imagegen.diffusion.upsampler   # noqa: F401  (diffusers finds GlideTextModel and ConditionSkipUNet through them)
    from diffusers import IFPipeline, IFSuperResolutionPipeline
    d, _ = glide2
    base = IFPipeline.from_pretrained(d/'run'/'model')
    img = base(prompt='a red circle', num_inference_steps=2, output_type='pt', clean_caption=False).images
    assert img.shape == (1, 3, 16, 16)
    up = IFSuperResolutionPipeline.from_pretrained(d/'up'/'model')
    assert type(up.unet).__name__ == 'ConditionSkipUNet' and up.unet.config.condition_skip_std == 0.05
    big = up(prompt='a red circle', image=img.clamp(-1, 1), num_inference_steps=2, output_type='pt', clean_caption=False).images
    assert big.shape == (1, 3, 32, 32)


def test_cascade_sampling_on_two_ranks_and_evaluation(glide2, tmp_path):
    d, _ = glide2
    args = ['--model', d/'run'/'model', '--upsampler', d/'up'/'model', '--shapes_split', 'test', '--n', 3, '--steps', 3,
            '--upsampler_steps', 2, '--batch_size', 2]
    launch('scripts/sample.py', *args, '--out', tmp_path/'two')
    run([sys.executable, 'scripts/sample.py', *map(str, args), '--upsampler_batch_size', '1', '--out', str(tmp_path/'one')])
    for sub in ('', 'base'):
        one = [json.loads(l) for l in (tmp_path/'one'/sub/'samples.jsonl').read_text().splitlines()]
        assert len(one) == 3 and one[0]['family'] == 'glide'
        for r in one:   # seed i gives image i, on 1 or 2 ranks, in batches of 2 or (upsampled) 1
            assert_same_image(tmp_path/'one'/sub/r['file_name'], tmp_path/'two'/sub/r['file_name'])
    p = run([sys.executable, 'scripts/evaluate.py', '--samples', str(tmp_path/'one'), '--feature', 'random', '--log_to_run', 'false',
             '--upsampler', str(d/'up'/'model'), '--upsampler_steps', '2', '--upsampler_batch_size', '2'])
    m = json.loads((tmp_path/'one'/'metrics.json').read_text())
    assert m['oracle/n'] == 3 and m['upsampler/oracle/n'] == 3 and 'bicubic' in p.stdout and m['upsampler/resolution'] == 32


def test_compile_is_off_unless_the_launcher_asks():
    code = "from accelerate import Accelerator; from imagegen.training.tracking import launcher_info; print(launcher_info(Accelerator(cpu=True))['dynamo_backend'])"
    env = {k: v for k, v in os.environ.items() if k != 'ACCELERATE_DYNAMO_BACKEND'}
    said = lambda e: subprocess.run([sys.executable, '-c', code], env=e, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()[-1]
    assert said(env) == 'NO'
    assert said({**env, 'ACCELERATE_DYNAMO_BACKEND': 'inductor'}) == 'INDUCTOR'   # what `accelerate launch --dynamo_backend inductor` sets


def test_user_errors_are_one_line(glide2, tmp_path):
    "Refused inputs, each run as its script's __main__ in one interpreter (conftest.run_many): exit 2, no traceback."
    from conftest import run_many
    d, _ = glide2
    upsampler_alone, bad_stage = run_many([('scripts/sample.py', ['--model', d/'up'/'model', '--prompts', 'a red circle']),
                                           ('scripts/train_glide.py', ['--stage', 'decoder', '--output_dir', tmp_path/'x'])])
    assert upsampler_alone['returncode'] == 2 and '--upsampler' in upsampler_alone['stderr'] and 'Traceback' not in upsampler_alone['stderr'], upsampler_alone['stderr'][-2000:]
    assert bad_stage['returncode'] == 2 and "invalid choice: 'decoder'" in bad_stage['stderr'], bad_stage['stderr'][-2000:]
