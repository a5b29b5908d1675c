"The training scripts take their mixed precision from the launcher and record the resolved configuration of every part."
import json, sys
from pathlib import Path

from conftest import BIN, ROOT, free_port, run


def vae_run(out, *launch_args, script_args=()):
    "scripts/train_vae.py for 2 steps on 16 Shapes images, in one process started by `accelerate launch`."
    cmd = [str(BIN/'accelerate'), 'launch', '--num_processes', '1', '--num_machines', '1', '--dynamo_backend', 'no',
           '--main_process_port', str(free_port()), *launch_args, str(ROOT/'scripts'/'train_vae.py'),
           '--output_dir', str(out), '--dataset', 'shapes:n=16', '--max_steps', '2', '--batch_size', '4',
           '--tracker', 'none', '--sample_every', '2', *script_args]
    run(cmd, env={'ACCELERATE_USE_CPU': '1'})
    return json.loads((Path(out)/'run_info.json').read_text())


def test_launcher_mixed_precision_reaches_the_accelerator(tmp_path):
    info = vae_run(tmp_path/'a', '--mixed_precision', 'bf16')
    assert info['config']['launcher']['mixed_precision'] == 'bf16'
    assert info['config']['train']['mixed_precision'] is None       # not set by the script: the launcher decides
    # an explicit script flag still wins over the launcher
    info = vae_run(tmp_path/'b', '--mixed_precision', 'bf16', script_args=('--mixed_precision', 'no'))
    assert info['config']['launcher']['mixed_precision'] == 'no'


def test_run_info_holds_model_and_data_and_vae_grid(tmp_path):
    info = vae_run(tmp_path, '--mixed_precision', 'no')
    cfg = info['config']
    assert cfg['data']['dataset'] == 'shapes:n=16' and cfg['model']['resolution'] == 32
    assert cfg['model']['latent_channels'] == 4 and cfg['model']['kl_weight'] == 1e-6
    assert cfg['train']['max_steps'] == 2 and cfg['launcher']['num_processes'] == 1
    from PIL import Image
    grid = Image.open(tmp_path/'samples'/'step_00000002.png')
    assert grid.width >= 3 * 128     # 8 tiles (4 pairs of a batch of 4) in 3 columns, each enlarged from 32 px to 128 px
