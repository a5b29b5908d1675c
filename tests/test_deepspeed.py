"""The shared loop under DeepSpeed ZeRO-2 and ZeRO-3 on 2 gloo CPU ranks (`accelerate launch --config_file
scripts/configs/accelerate/zero2.yaml|zero3.yaml`, the files users launch with on GPUs; DeepSpeed's CPU accelerator
runs the same engine over gloo): DDP's losses and weights, each rank holding half of the parameters under ZeRO-3, exact
resume from DeepSpeed's checkpoint, an exported folder that diffusers' pipeline loads, the NaN guard, and the refusals.
tests/dist_probe.py records what each rank held."""
import json, shutil, sys
from pathlib import Path
import pytest, torch
from conftest import ROOT, launch, rank_records, run
from test_fsdp import ARGS, FAMILIES, NAN_RUN, VQ, folder_tensors, gpt_grpo_matches_ddp, launch_config, max_diff, shapes, unet

pytest.importorskip('deepspeed')


def launch_zero(stage:int, script, *args, **kwargs):
    "`launch_config` with the repository's ZeRO-`stage` accelerate config (scripts/configs/accelerate/zero<stage>.yaml)."
    return launch_config(f'zero{stage}', script, *args, **kwargs)


def close_to_ddp(a:dict, b:dict, lr:float=1e-3):
    """Weights after 4 AdamW steps at `lr` agree with DDP's but for rounding: DeepSpeed reduces gradients in other
    buckets and orders than DDP (~1e-7 relative), which Adam's first steps (the update is about lr times the gradient's
    sign) turn into visible gaps only where a gradient is near zero. Measured: ZeRO-2 2.8e-6 at most; ZeRO-3 1.2e-4 at
    most, in 35 of 3.9M weights. A rank that trained on its own gradients, or a wrong gather, moves most weights by
    about lr."""
    assert a.keys() == b.keys()
    worst = max_diff(a, b)
    off = sum(int(((a[k].float() - b[k].float()).abs() > 1e-5).sum()) for k in a)
    n = sum(v.numel() for v in a.values())
    assert worst < lr / 4 and off < 1e-4 * n, f"max gap {worst:.3g}, {off} of {n} weights more than 1e-5 apart"


@pytest.fixture(scope='module')
def runs(shapes, tmp_path_factory):
    "The tiny latent diffusion model trained 4 steps on 2 ranks under DDP, ZeRO-2 and ZeRO-3, from the same seed and data."
    d = tmp_path_factory.mktemp('zero')
    launch('scripts/train_ldm.py', '--output_dir', d/'ddp', '--dataset', shapes, *ARGS, probe=d/'probe_ddp')
    for s in (2, 3): launch_zero(s, 'scripts/train_ldm.py', '--output_dir', d/f'zero{s}', '--dataset', shapes, *ARGS, probe=d/f'probe_zero{s}')
    return d, {k: rank_records(d/f'probe_{k}', 2) for k in ('ddp', 'zero2', 'zero3')}


@pytest.mark.parametrize('stage', [2, 3])
def test_zero_trains_like_ddp(runs, stage):
    "The same losses (to 1e-6), and model, EMA and checkpoint EMA within `close_to_ddp`; DeepSpeed's own checkpoint of 2 ranks."
    d, rec = runs
    for r in (0, 1):
        assert rec[f'zero{stage}'][r]['losses'] == pytest.approx(rec['ddp'][r]['losses'], rel=1e-6, abs=1e-7)
    close_to_ddp(unet(d/'ddp'), unet(d/f'zero{stage}'))
    from safetensors.torch import load_file
    ema = [load_file(str(x/'checkpoints'/'step_00000004'/'ema.safetensors')) for x in (d/'ddp', d/f'zero{stage}')]
    close_to_ddp(*ema)
    ck = d/f'zero{stage}'/'checkpoints'/'step_00000004'
    assert len(list((ck/'pytorch_model').glob('zero_pp_rank_*_optim_states.pt'))) == 2 and not (ck/'model.safetensors').exists()


def test_zero3_each_rank_holds_half_the_parameters(runs):
    "Under ZeRO-3 each rank's slices (`ds_tensor`) are half of every parameter (padded to equal halves); under ZeRO-2 each rank holds them all."
    _, rec = runs
    whole = rec['ddp'][0]['param_numel']
    assert rec['zero2'][0]['params'].numel() == rec['zero2'][1]['params'].numel() == whole
    held = [rec['zero3'][r]['params'].numel() for r in (0, 1)]
    assert rec['zero3'][0]['param_numel'] == whole and held[0] == held[1] and whole <= sum(held) < whole * 1.001, (held, whole)


def test_zero3_samples_on_every_rank_and_exports_a_whole_folder(runs):
    """Validation grids come from the partitioned model (every rank gathers, rank 0 writes) and look like DDP's; the saved
    folder is whole and float32, and StableDiffusionPipeline loads it with DDP's weights."""
    from diffusers import StableDiffusionPipeline
    from conftest import assert_same_image
    d, rec = runs
    for step in (2, 4): assert (d/'zero3'/'samples'/f'step_{step:08d}.png').is_file()
    assert not [p for _, p in rec['zero3'][1]['writes'] if 'samples' in p and p.endswith('.png')]
    assert_same_image(d/'ddp'/'samples'/'step_00000004.png', d/'zero3'/'samples'/'step_00000004.png', levels=2, share=0.02)
    pipe = StableDiffusionPipeline.from_pretrained(str(d/'zero3'/'model'), safety_checker=None)
    assert pipe.unet.dtype == torch.float32
    close_to_ddp(unet(d/'ddp'), {k: v for k, v in pipe.unet.state_dict().items()})


@pytest.mark.parametrize('stage', [2, 3])
def test_zero_resume_is_exact(runs, shapes, tmp_path, stage):
    """Resumed from DeepSpeed's step-2 checkpoint (read without running code first; ZeRO-2 writes the model states once,
    ZeRO-3 once per rank), the run ends with the uninterrupted run's weights and EMA, bit for bit."""
    d, _ = runs
    res = tmp_path/'res'
    res.mkdir()
    for name in ('checkpoints', 'config.yaml', 'initial_model', 'run_info.json'):
        (shutil.copytree if (d/f'zero{stage}'/name).is_dir() else shutil.copy)(d/f'zero{stage}'/name, res/name)
    shutil.rmtree(res/'checkpoints'/'step_00000004'); (res/'checkpoints'/'latest').write_text('step_00000002')
    p = launch_zero(stage, 'scripts/train_ldm.py', '--output_dir', res, '--dataset', shapes, *ARGS, probe=tmp_path/'probe')
    assert 'resuming from' in p.stdout + p.stderr
    assert rank_records(tmp_path/'probe', 2)[0]['start_step'] == 2
    assert max_diff(unet(d/f'zero{stage}'), unet(res)) == 0
    from safetensors.torch import load_file
    assert max_diff(*[load_file(str(x/'checkpoints'/'step_00000004'/'ema.safetensors')) for x in (d/f'zero{stage}', res)]) == 0


def test_deepspeed_checkpoint_elsewhere_is_refused_clearly(runs, shapes, tmp_path):
    """A DeepSpeed checkpoint resumed by one process (no DeepSpeed) stops in one line that says how to resume it or export
    it; a planted pickle in it is refused before DeepSpeed's own loader (which runs pickles) sees it."""
    d, _ = runs
    res = tmp_path/'res'
    shutil.copytree(d/'zero3', res); shutil.rmtree(res/'model')
    cmd = [sys.executable, 'scripts/train_ldm.py', '--output_dir', str(res), '--dataset', str(shapes), *map(str, ARGS), '--max_steps', '6']
    p = run(cmd, check=False)
    assert p.returncode == 2 and 'Traceback' not in p.stderr, p.stderr[-2000:]
    assert 'under DeepSpeed ZeRO-3 by 2 ranks' in p.stderr and 'export_checkpoint.py' in p.stderr
    import pickle
    class Payload:
        def __reduce__(self): return (exec, ("open('PWNED', 'w').write('x')",))
    for ck in (res/'checkpoints').glob('step_*'):
        f = ck/'pytorch_model'/'zero_pp_rank_0_mp_rank_00_model_states.pt'
        state = torch.load(str(f), weights_only=True)
        state['planted'] = Payload()
        torch.save(state, str(f))
    from imagegen.training.checkpoints import CheckpointError, check_checkpoint
    with pytest.raises(CheckpointError, match='code planted in it would run'): check_checkpoint(res/'checkpoints'/'step_00000004')
    p = launch_zero(3, 'scripts/train_ldm.py', '--output_dir', res, '--dataset', shapes, *ARGS, '--max_steps', 6, check=False)
    assert p.returncode != 0 and 'code planted' in p.stderr and not (ROOT/'PWNED').exists() and not Path('PWNED').exists()


@pytest.mark.parametrize('stage', [2, 3])
def test_zero_nan_gradients_never_reach_the_weights(tmp_path, stage):
    "DeepSpeed skips a step whose gradient norm is not finite; the loop counts it, stops after nan_max_consecutive, and the weights stay finite on both ranks."
    (tmp_path/'nan.py').write_text(NAN_RUN)
    (tmp_path/'run').mkdir()
    launch_zero(stage, tmp_path/'nan.py', tmp_path/'run', ROOT/'tests')
    for r in (0, 1):
        got = json.loads((tmp_path/'run'/f'nan_rank{r}.json').read_text())
        assert got['finite'] and 'nan_max_consecutive=2' in (got['error'] or ''), got


def test_zero3_init_flag_and_a_clipping_conflict_are_refused(shapes, tmp_path):
    """Settings the loop cannot honour stop every rank with one line naming the flag: zero3_init_flag, a clipping value
    other than --max_grad_norm, and ACCELERATE_USE_CPU=1 (with which accelerate drops DeepSpeed and would train DDP)."""
    p = launch_zero(3, 'scripts/train_ldm.py', '--output_dir', tmp_path/'a', '--dataset', shapes, *ARGS, launcher=['--zero3_init_flag', 'true'], check=False)
    assert p.returncode != 0 and '--zero3_init_flag false' in p.stderr, p.stderr[-2000:]
    p = launch_zero(2, 'scripts/train_ldm.py', '--output_dir', tmp_path/'b', '--dataset', shapes, *ARGS, '--max_grad_norm', 0.5,
                    launcher=['--gradient_clipping', '1.0'], check=False)
    assert p.returncode != 0 and 'max_grad_norm=0.5' in p.stderr, p.stderr[-2000:]
    p = launch_zero(2, 'scripts/train_ldm.py', '--output_dir', tmp_path/'c', '--dataset', shapes, *ARGS, env={'ACCELERATE_USE_CPU': '1'}, check=False)
    assert p.returncode != 0 and 'ACCELERATE_USE_CPU=1 turns DeepSpeed off' in p.stderr, p.stderr[-2000:]


@pytest.mark.slow
def test_zero2_bf16_autocasts_with_float32_weights(runs, shapes, tmp_path):
    """`--mixed_precision bf16` under DeepSpeed becomes its torch_autocast: the weights (and so the exported folder) stay
    float32 while the forward runs in bfloat16, so the losses are DDP's float32 ones to bfloat16's precision, not equal."""
    d, rec = runs
    launch_zero(2, 'scripts/train_ldm.py', '--output_dir', tmp_path/'run', '--dataset', shapes, *ARGS, probe=tmp_path/'probe',
                launcher=['--mixed_precision', 'bf16'])
    mp = rank_records(tmp_path/'probe', 2)
    for r in (0, 1):
        assert mp[r]['param_dtypes'] == ['torch.float32']
        assert mp[r]['losses'] == pytest.approx(rec['ddp'][r]['losses'], rel=1e-2) and mp[r]['losses'] != rec['ddp'][r]['losses']
    assert {v.dtype for v in unet(tmp_path/'run').values()} == {torch.float32}
    launcher = json.loads((tmp_path/'run'/'run_info.json').read_text())['config']['launcher']
    assert (launcher['distributed_type'], launcher['mixed_precision']) == ('DEEPSPEED', 'bf16'), launcher   # recorded as run


@pytest.mark.slow
@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_family_trains_under_zero3_like_ddp(family, tmp_path):
    "The latent GPT and GLIDE (each a wrapper around two trained models) under ZeRO-3: DDP's losses, half the parameters per rank, an exported folder with DDP's weights."
    script, args = FAMILIES[family]
    if family == 'gpt':
        from diffusers import VQModel
        torch.manual_seed(0); VQModel(**VQ).save_pretrained(tmp_path/'vq'); args = ['--vqvae', tmp_path/'vq', *args]
    common = [*args, '--max_steps', 4, '--batch_size', 4, '--checkpoint_every', 2, '--report_to', 'none']
    launch(script, '--output_dir', tmp_path/'ddp', *common, probe=tmp_path/'p_ddp')
    launch_zero(3, script, '--output_dir', tmp_path/'zero3', *common, probe=tmp_path/'p_zero3')
    ddp, z3 = rank_records(tmp_path/'p_ddp', 2), rank_records(tmp_path/'p_zero3', 2)
    assert z3[0]['losses'] == pytest.approx(ddp[0]['losses'], rel=1e-5, abs=1e-6)
    assert z3[0]['params'].numel() < 0.6 * ddp[0]['params'].numel()
    a, b = folder_tensors(tmp_path/'ddp'/'model'), folder_tensors(tmp_path/'zero3'/'model')
    close_to_ddp(a, b)


def test_grpo_under_zero3_matches_ddp(tmp_path):
    """GRPO of a latent GPT under ZeRO-3 (`gpt_grpo_matches_ddp`): its rollouts call the GPT's sampler outside DeepSpeed's
    forward with every parameter gathered (`full_policy`); without the gather the first rollout fails."""
    gpt_grpo_matches_ddp(tmp_path, 'zero3')


@pytest.mark.parametrize('stage', [2, 3])
def test_export_checkpoint_puts_zero_partitions_together(runs, tmp_path, stage):
    """export_checkpoint.py joins a ZeRO checkpoint's partitions (DeepSpeed's zero_to_fp32, in one process, after the
    checkpoint is read without running code) into the folder DDP's checkpoint gives, to `close_to_ddp`."""
    d, _ = runs
    for r in ('ddp', f'zero{stage}'):
        run([sys.executable, 'scripts/export_checkpoint.py', '--run', str(d/r), '--step', '4', '--ema', 'false', '--output_dir', str(tmp_path/r)])
    raw = [unet(tmp_path/r) for r in ('ddp', f'zero{stage}')]
    close_to_ddp(*raw)
    assert max_diff(raw[1], unet(d/f'zero{stage}')) > 1e-4   # raw weights, not the EMA the run saved


FROZEN_RUN = """
"Under ZeRO-3, after the loop's accelerator exists: a text model loaded with from_pretrained (as the frozen encoders are) is whole. argv: SAVED OUT."
import json, sys, torch
from transformers import CLIPTextModel
from transformers.integrations import is_deepspeed_zero3_enabled
from imagegen.training.loop import TrainConfig, make_accelerator
acc = make_accelerator(TrainConfig(tracker='none'))
m = CLIPTextModel.from_pretrained(sys.argv[1])
ids = torch.tensor([[1, 2, 3]])
json.dump({'zero3_seen_by_transformers': is_deepspeed_zero3_enabled(), 'numel': [p.numel() for p in m.parameters()][:3],
           'out': m(ids).last_hidden_state.sum().item()}, open(f"{sys.argv[2]}/frozen_rank{acc.process_index}.json", 'w'))
"""


def test_zero3_leaves_frozen_pretrained_models_whole(tmp_path):
    """accelerate registers its ZeRO-3 config with transformers even with zero3_init_flag off, which would make every
    later `from_pretrained` (the frozen text encoders, CLIP for metrics) build its model partitioned, with empty weights
    outside DeepSpeed's engine; the loop undoes that registration, so they load whole and give the one-process output."""
    from transformers import CLIPTextConfig, CLIPTextModel
    torch.manual_seed(0)
    m = CLIPTextModel(CLIPTextConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    m.save_pretrained(tmp_path/'te')
    want = m(torch.tensor([[1, 2, 3]])).last_hidden_state.sum().item()
    (tmp_path/'frozen.py').write_text(FROZEN_RUN)
    launch_zero(3, tmp_path/'frozen.py', tmp_path/'te', tmp_path)
    for r in (0, 1):
        got = json.loads((tmp_path/f'frozen_rank{r}.json').read_text())
        assert not got['zero3_seen_by_transformers'] and min(got['numel']) > 0 and got['out'] == pytest.approx(want, rel=1e-5), got
