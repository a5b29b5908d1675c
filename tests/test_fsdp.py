"""The shared loop under FSDP2 on 2 gloo CPU ranks (`accelerate launch --use_fsdp --fsdp_version 2`, as on GPUs; the loop
turns FSDP on for CPU ranks, where accelerate leaves it off): the same losses, gradient norms and weights as DDP on the
same data for each family, each family's blocks as the FSDP units, each rank holding about half of the parameters, the
NaN guard, exact resume from a sharded checkpoint (also after a rank died mid-save), and an exported folder that
diffusers' pipeline loads. tests/dist_probe.py records what each rank held."""
import json, shutil, sys
from pathlib import Path
import pytest, torch
from conftest import ROOT, free_port, launch, rank_records, run

ARGS = ['--max_steps', 4, '--batch_size', 4, '--lr', 1e-3, '--warmup_steps', 0, '--tracker', 'none', '--sample_every', 2, '--n_samples', 2,
        '--checkpoint_every', 2, '--ema', '--ema_decay', 0.9]


def launch_config(name:str, script, *args, probe=None, timeout=600, launcher=(), check=True, env=None):
    """`launch` with the repository's accelerate config `name` (scripts/configs/accelerate/NAME.yaml: fsdp2, zero2,
    zero3; the files users launch with on GPUs) on 2 CPU ranks, no mixed precision (command-line flags override the
    file; `launcher`: more `accelerate launch` flags). FSDP2 needs accelerate's CPU flag; DeepSpeed finds the CPU
    itself, and that flag (which `make test` exports without GPUs) would make accelerate launch DDP instead."""
    target = [str(ROOT/'tests'/'dist_probe.py'), str(probe)] if probe else []
    cmd = [str(Path(sys.executable).parent/'accelerate'), 'launch', '--config_file', str(ROOT/'scripts'/'configs'/'accelerate'/f'{name}.yaml'),
           '--num_processes', '2', '--num_machines', '1', '--mixed_precision', 'no', '--dynamo_backend', 'no', *map(str, launcher),
           '--main_process_port', str(free_port()), *target, str(ROOT/script if not Path(script).is_absolute() else script), *map(str, args)]
    cpu = {'ACCELERATE_USE_CPU': '1'} if name == 'fsdp2' else {'ACCELERATE_USE_CPU': '0', 'OMP_NUM_THREADS': '1'}
    return run(cmd, env={**cpu, **(env or {})}, timeout=timeout, check=check)


def launch_fsdp(script, *args, **kwargs):
    "`launch_config` with scripts/configs/accelerate/fsdp2.yaml."
    return launch_config('fsdp2', script, *args, **kwargs)


def two_stage_grpo_under_fsdp_and_ddp(tmp_path, script:str, load, stages, tol:float):
    """Run a two-stage GRPO test `script` (argv OUT split: rollout r on rank r; it writes OUT/seen_rank<r>.json, each update's
    `[stage-1 ratio min, max, stage-2 min, max, ...]`) on 2 ranks under DDP and under FSDP2 (its rollouts inside
    `full_policy`), and assert: ratio exactly 1 for both stages at each rank's first update under FSDP2, each rank's ratio
    ranges DDP's to `tol`, and each stage's weights (`stages`: getters on `load(OUT/'model')`) DDP's to `tol`."""
    (tmp_path/'grpo.py').write_text(script)
    launch(tmp_path/'grpo.py', tmp_path/'ddp', 'split')
    launch_fsdp(tmp_path/'grpo.py', tmp_path/'fsdp', 'split')
    for r in (0, 1):
        ddp, fsdp = ([v for x in json.loads((tmp_path/m/f'seen_rank{r}.json').read_text()) for v in x[:4]] for m in ('ddp', 'fsdp'))
        assert fsdp[:4] == [1.0] * 4, f"rank {r}: the first update under FSDP2 had ratio ranges {fsdp[:4]}"
        assert fsdp == pytest.approx(ddp, abs=tol), f"rank {r}: ratio ranges under FSDP2 {fsdp}, under DDP {ddp}"
    a, b = (load(tmp_path/m/'model') for m in ('ddp', 'fsdp'))
    flat = lambda mod: torch.cat([p.detach().flatten() for p in mod.parameters()])
    for i, get in enumerate(stages):
        gap = (flat(get(a)) - flat(get(b))).abs().max().item()
        assert gap < tol, f"stage {i + 1}: FSDP2 ends {gap:.3g} away from DDP"


NAN_RUN = '''
"The regression task of tests/test_training.py with NaN gradients from its 4th batch on, on 2 ranks (FSDP2 or DeepSpeed); argv: OUT TESTS_DIR."
import json, sys
sys.path.insert(0, sys.argv[2])
import torch
from test_training import Regression, cfg, data
from imagegen.training.checkpoints import local_part
from imagegen.training.loop import NonFiniteLossError, train
class NaNGrad(Regression):   # a finite loss with NaN gradients (d sqrt(x)/dx at 0, times 0) for every weight, from batch `at` on
    def __init__(self, at): super().__init__(); self.at, self.calls = at, 0
    def loss(self, model, batch):
        out = super().loss(model, batch)
        self.calls += 1
        if self.calls > self.at: out['loss'] = out['loss'] + 0 * torch.sqrt(0 * out['loss'])
        return out
task = NaNGrad(at=3)
try: train(task, data(), cfg(sys.argv[1], max_grad_norm=None, nan_max_consecutive=2, checkpoint_every=1)); err = None
except NonFiniteLossError as e: err = str(e)
import torch.distributed as dist
ps = list(task.trainable.parameters())
json.dump({'error': err, 'finite': all(bool(torch.isfinite(local_part(p)).all()) for p in ps), 'sharded': any(local_part(p) is not p for p in ps)},
          open(f"{sys.argv[1]}/nan_rank{dist.get_rank()}.json", 'w'))
'''


@pytest.fixture(scope='module')
def shapes(tmp_path_factory):
    d = tmp_path_factory.mktemp('shapes')
    run([sys.executable, 'scripts/make_shapes.py', '--out', str(d), '--n_train', '32', '--n_validation', '0', '--n_test', '0'])
    return d/'imagefolder'/'train'


@pytest.fixture(scope='module')
def runs(shapes, tmp_path_factory):
    "The tiny latent diffusion model trained 4 steps on 2 ranks, once under DDP and once under FSDP2, from the same seed and data."
    d = tmp_path_factory.mktemp('fsdp')
    launch('scripts/train_ldm.py', '--output_dir', d/'ddp', '--dataset', shapes, *ARGS, probe=d/'probe_ddp')
    launch_fsdp('scripts/train_ldm.py', '--output_dir', d/'fsdp', '--dataset', shapes, *ARGS, '--ddp_timeout', 4321, probe=d/'probe_fsdp')
    return d, rank_records(d/'probe_ddp', 2), rank_records(d/'probe_fsdp', 2)


def unet(folder):
    "The UNet weights of a run's model/ folder, or of an exported model folder."
    from safetensors.torch import load_file
    f = Path(folder)/'unet'/'diffusion_pytorch_model.safetensors'
    return load_file(str(f if f.exists() else Path(folder)/'model'/'unet'/'diffusion_pytorch_model.safetensors'))


def max_diff(a:dict, b:dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_fsdp_trains_like_ddp(runs):
    """The same losses, and weights (model and EMA) within 1e-4 after 4 AdamW steps at lr 1e-3: FSDP2 reduce-scatters
    the gradients where DDP all-reduces them, so sums round in another order (~1e-7 relative); Adam's first steps divide
    by the gradient's own size, so a weight may move by up to ~lr times that rounding's relative effect, far below 1e-4
    (measured: 2.3e-5). A broken gather or an unsynchronised rank moves weights by the learning rate itself (1e-3)."""
    d, ddp, fsdp = runs
    for r in (0, 1): assert fsdp[r]['losses'] == pytest.approx(ddp[r]['losses'], rel=1e-6, abs=1e-7), (fsdp[r]['losses'], ddp[r]['losses'])
    assert max_diff(unet(d/'ddp'), unet(d/'fsdp')) < 1e-4
    from safetensors.torch import load_file
    ema = [load_file(str(d/r/'checkpoints'/'step_00000004'/'ema.safetensors')) for r in ('ddp', 'fsdp')]
    assert max_diff(*ema) < 1e-4
    assert (d/'fsdp'/'checkpoints'/'step_00000004'/'pytorch_model_fsdp_0'/'.metadata').is_file()   # a sharded checkpoint


def test_fsdp_units_are_the_unet_blocks(runs):
    """accelerate's FSDP2 wraps what `fsdp_wrap_policy` names: each of the UNet's own block classes (its
    `_no_split_modules` found in it) becomes a unit, the UNet the root unit around them, and accelerate gives the final
    norm (`conv_norm_out`, a GroupNorm) a unit of its own. A policy left unset would wrap the root and that norm alone:
    the other tests here still pass then (each rank still holds half of each tensor), this one not."""
    from diffusers import UNet2DConditionModel
    d, ddp, fsdp = runs
    u = UNet2DConditionModel.from_pretrained(d/'ddp'/'model'/'unet')
    blocks = [type(m).__name__ for m in u.modules() if type(m).__name__ in u._no_split_modules]
    assert len(blocks) >= 4, blocks
    for r in (0, 1):
        units = fsdp[r]['fsdp_units']
        tail = [u for u in units[1:] if u not in blocks]
        assert units[0] == 'UNet2DConditionModel' and tail == ['GroupNorm'], units
        assert sorted(u for u in units[1:] if u in blocks) == sorted(blocks), (units, blocks)
    assert ddp[0]['fsdp_units'] == []


def test_fsdp_clips_by_the_norm_over_every_shard(runs):
    """Clipping (`max_grad_norm` 1.0, the default, is below these first norms, so every update here is clipped) uses
    the gradient norm over all ranks' slices: DDP's norm of the whole gradient, step by step. Clipping each rank's
    slices by their own norm logs 0.71 of it here (about 1/sqrt(2), measured with that mistake made on purpose), and
    the losses then leave DDP's from the second step."""
    _, ddp, fsdp = runs
    assert min(ddp[0]['grad_norms']) > 1.0, ddp[0]['grad_norms']
    for r in (0, 1): assert fsdp[r]['grad_norms'] == pytest.approx(ddp[r]['grad_norms'], rel=1e-4), (fsdp[r]['grad_norms'], ddp[r]['grad_norms'])


def test_fsdp_nan_gradients_never_reach_the_weights(tmp_path):
    """The NaN guard on sharded gradients: the norm over every rank's slices is not finite, so each rank skips the same
    updates, the loop stops after nan_max_consecutive with its error on both ranks, and no slice of the weights holds a NaN."""
    (tmp_path/'nan.py').write_text(NAN_RUN)
    (tmp_path/'run').mkdir()
    launch_fsdp(tmp_path/'nan.py', tmp_path/'run', ROOT/'tests')
    for r in (0, 1):
        got = json.loads((tmp_path/'run'/f'nan_rank{r}.json').read_text())
        assert got['sharded'] and got['finite'] and 'nan_max_consecutive=2' in (got['error'] or ''), got


def test_ddp_timeout_reaches_the_process_group(runs):
    "`--ddp_timeout` (transformers' flag) is the time-out every rank's process group waits at a collective; 30 min without it."
    _, ddp, fsdp = runs
    assert [r['pg_timeout_s'] for r in ddp] == [1800.0] * 2 and [r['pg_timeout_s'] for r in fsdp] == [4321.0] * 2, (ddp[0]['pg_timeout_s'], fsdp[0]['pg_timeout_s'])


def test_fsdp_validation_grids_every_rank_samples_one_writes(runs):
    "Validation sampling from the sharded model (every rank runs the forwards, which gather weights): rank 0 writes the grids, the same as DDP's."
    d, _, fsdp = runs
    for step in (2, 4): assert (d/'fsdp'/'samples'/f'step_{step:08d}.png').is_file()
    assert not [p for _, p in fsdp[1]['writes'] if 'samples' in p and p.endswith('.png')]
    from conftest import assert_same_image
    assert_same_image(d/'ddp'/'samples'/'step_00000004.png', d/'fsdp'/'samples'/'step_00000004.png', levels=2, share=0.02)


def test_each_rank_holds_half_the_parameters(runs):
    "Under FSDP2 each rank keeps its slice (about half); under DDP each keeps all of them."
    _, ddp, fsdp = runs
    whole = ddp[0]['param_numel']
    assert ddp[0]['params'].numel() == ddp[1]['params'].numel() == whole
    held = [fsdp[r]['params'].numel() for r in (0, 1)]
    assert sum(held) == whole and all(0.4 * whole < h < 0.6 * whole for h in held), (held, whole)


def test_bf16_mixed_precision_with_cpu_offload_keeps_float32_master_weights(runs, shapes, tmp_path):
    """`--mixed_precision bf16` under FSDP2 with the launcher's CPU offload on: accelerate's policy gathers each unit's
    weights in bfloat16 for the forward (seen inside the first layer's forward) while the slices the optimizer steps
    stay float32; the losses are the float32 DDP run's to bfloat16's precision (measured: the first equal, then 5e-4
    apart). On CPU ranks the offload runs its code path without pinned memory (pinning needs an accelerator), so it
    saves nothing here; the model is exported whole and in float32."""
    from diffusers import StableDiffusionPipeline
    d, ddp, _ = runs
    launch_fsdp('scripts/train_ldm.py', '--output_dir', tmp_path/'run', '--dataset', shapes, *ARGS, '--mixed_precision', 'bf16',
                probe=tmp_path/'probe', launcher=['--fsdp_offload_params', 'true'])
    mp = rank_records(tmp_path/'probe', 2)
    assert ddp[0]['compute_dtype'] == 'torch.float32'
    for r in (0, 1):
        assert (mp[r]['param_dtypes'], mp[r]['compute_dtype']) == (['torch.float32'], 'torch.bfloat16'), (mp[r]['param_dtypes'], mp[r]['compute_dtype'])
        assert mp[r]['losses'] == pytest.approx(ddp[r]['losses'], rel=1e-2), (mp[r]['losses'], ddp[r]['losses'])
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path/'run'/'model', safety_checker=None)
    assert pipe.unet.dtype == torch.float32


@pytest.mark.slow
def test_cached_latents_and_text_embeddings_under_fsdp_match_ddp(shapes, tmp_path):
    """`--cache_latents --cache_text_embeddings` under FSDP2: the ranks split the encoding with the frozen VAE and text
    encoder (outside the sharded model's forward) into one on-disk cache, and train on it with DDP's losses (measured:
    equal) and half the parameters each. Slow: a second data path of the fixture's run."""
    args = ['--dataset', shapes, *ARGS, '--cache_latents', '--cache_text_embeddings']
    launch('scripts/train_ldm.py', '--output_dir', tmp_path/'ddp', *args, probe=tmp_path/'p_ddp')
    launch_fsdp('scripts/train_ldm.py', '--output_dir', tmp_path/'fsdp', *args, probe=tmp_path/'p_fsdp')
    ddp, fsdp = rank_records(tmp_path/'p_ddp', 2), rank_records(tmp_path/'p_fsdp', 2)
    for r in (0, 1):
        assert fsdp[r]['losses'] == pytest.approx(ddp[r]['losses'], rel=1e-6, abs=1e-7), (fsdp[r]['losses'], ddp[r]['losses'])
        assert fsdp[r]['params'].numel() < 0.6 * fsdp[r]['param_numel']
    assert max_diff(unet(tmp_path/'ddp'), unet(tmp_path/'fsdp')) < 1e-4


def stopped_at_step_2(run:Path, res:Path) -> Path:
    "A copy of the 4-step `run` as it stood after its step-2 checkpoint: what a run stopped there leaves to resume."
    res.mkdir()
    for name in ('checkpoints', 'config.yaml', 'initial_model', 'run_info.json'):
        (shutil.copytree if (run/name).is_dir() else shutil.copy)(run/name, res/name)
    shutil.rmtree(res/'checkpoints'/'step_00000004'); (res/'checkpoints'/'latest').write_text('step_00000002')
    return res


def test_fsdp_resume_is_exact(runs, shapes, tmp_path):
    "Resumed from the sharded step-2 checkpoint, the run ends with the uninterrupted run's weights and EMA, bit for bit."
    d, _, _ = runs
    res = stopped_at_step_2(d/'fsdp', tmp_path/'res')
    p = launch_fsdp('scripts/train_ldm.py', '--output_dir', res, '--dataset', shapes, *ARGS, probe=tmp_path/'probe')
    assert 'resuming from' in p.stdout + p.stderr
    assert rank_records(tmp_path/'probe', 2)[0]['start_step'] == 2
    assert max_diff(unet(d/'fsdp'), unet(res)) == 0
    from safetensors.torch import load_file
    assert max_diff(*[load_file(str(x/'checkpoints'/'step_00000004'/'ema.safetensors')) for x in (d/'fsdp', res)]) == 0


KILL_IN_SAVE = """"Run a training script (argv[1:]) with rank 1 killed (SIGKILL) as the sharded save of step 4 begins, rank 0 gone on into it."
import os, runpy, signal, sys, accelerate
save = accelerate.Accelerator.save_state
def dying(self, output_dir=None, **kwargs):
    if 'step_00000004' in str(output_dir) and self.process_index == 1: os.kill(os.getpid(), signal.SIGKILL)
    return save(self, output_dir, **kwargs)
accelerate.Accelerator.save_state = dying
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def test_rank_killed_while_saving_keeps_the_last_checkpoint(runs, shapes, tmp_path):
    """A rank that dies in the middle of a sharded save (the launcher then stops the other) leaves the previous
    checkpoint as `latest`, whole; the half-written step is never taken for a checkpoint, and the next launch resumes
    from the step before it and ends where the uninterrupted run ended, bit for bit."""
    from imagegen.training.checkpoints import latest_checkpoint
    d, _, _ = runs
    (tmp_path/'kill.py').write_text(KILL_IN_SAVE)
    args = ['--output_dir', tmp_path/'run', '--dataset', shapes, *ARGS]
    p = launch_fsdp(tmp_path/'kill.py', ROOT/'scripts'/'train_ldm.py', *args, check=False)
    assert p.returncode != 0, p.stderr[-2000:]
    ck = tmp_path/'run'/'checkpoints'
    assert latest_checkpoint(ck).name == 'step_00000002' and not (ck/'step_00000004').exists(), sorted(x.name for x in ck.iterdir())
    launch_fsdp('scripts/train_ldm.py', *args, probe=tmp_path/'probe')
    assert rank_records(tmp_path/'probe', 2)[0]['start_step'] == 2 and latest_checkpoint(ck).name == 'step_00000004'
    assert max_diff(unet(d/'fsdp'), unet(tmp_path/'run')) == 0


def test_fsdp_resumes_on_another_number_of_ranks(runs, shapes, tmp_path):
    """torch's distributed checkpoint reshards on load: the 2-rank step-2 checkpoint resumes on 3 ranks and trains to step
    4, each rank from step 2, saying once (not once per rank) that a batch of the epoch is repeated (4 done by 2 ranks)."""
    d, _, _ = runs
    res = stopped_at_step_2(d/'fsdp', tmp_path/'res')
    p = launch_fsdp('scripts/train_ldm.py', '--output_dir', res, '--dataset', shapes, *ARGS, probe=tmp_path/'probe', launcher=['--num_processes', 3])
    recs = rank_records(tmp_path/'probe', 3)
    assert [(r['world_size'], r['start_step'], r['end_step']) for r in recs] == [(3, 2, 4)] * 3
    assert (p.stdout + p.stderr).count('with 3 ranks 1 are repeated') == 1, p.stderr[-3000:]
    assert (res/'checkpoints'/'step_00000004'/'pytorch_model_fsdp_0'/'.metadata').is_file()


def test_fsdp_export_loads_in_diffusers(runs, tmp_path):
    """The folder saved from the sharded model is whole: StableDiffusionPipeline loads it, with the DDP run's weights; and
    export_checkpoint.py puts a sharded checkpoint's raw weights together (one process, no ranks) as DDP's are."""
    from diffusers import StableDiffusionPipeline
    d, _, _ = runs
    pipe = StableDiffusionPipeline.from_pretrained(str(d/'fsdp'/'model'), safety_checker=None)
    sd = {k: v for k, v in pipe.unet.state_dict().items()}
    assert max_diff(sd, unet(d/'ddp')) < 1e-4
    for r in ('ddp', 'fsdp'):
        run([sys.executable, 'scripts/export_checkpoint.py', '--run', str(d/r), '--step', '4', '--ema', 'false', '--output_dir', str(tmp_path/r)])
    raw = [unet(tmp_path/r) for r in ('ddp', 'fsdp')]
    assert max_diff(*raw) < 1e-4 and max_diff(raw[1], unet(d/'fsdp')) > 1e-4   # raw weights, not the EMA the run saved


def folder_tensors(d) -> dict:
    "Every tensor of every safetensors file under folder `d`, keyed 'file:name'."
    from safetensors.torch import load_file
    return {f'{f.relative_to(d)}:{k}': v for f in sorted(Path(d).rglob('*.safetensors')) for k, v in load_file(str(f)).items()}


VQ = dict(block_out_channels=(16, 32, 32), down_block_types=('DownEncoderBlock2D',) * 3, up_block_types=('UpDecoderBlock2D',) * 3,
          latent_channels=8, vq_embed_dim=8, num_vq_embeddings=64, norm_num_groups=8, sample_size=32)
FAMILIES = {   # the other two families' tiny runs, their text encoders trained too (a wrapper module around two models)
    'gpt': ('scripts/train_gpt.py', ['--dataset', 'shapes:n=32', '--n_layer', 1, '--n_embd', 32, '--n_head', 2, '--text_hidden', 32,
                                     '--text_layers', 1, '--train_text_encoder']),
    'glide': ('scripts/train_glide.py', ['--dataset', 'shapes:n=32', '--resolution', 16, '--block_out_channels', '32,32',
                                         '--attention_levels', 'false,true', '--text_width', 32, '--text_ctx', 16, '--text_layers', 1])}


WRAPPER = {'gpt': 'GPTWithTextEncoder', 'glide': 'UNetWithTextEncoder'}
BLOCKS = {'gpt': {'Block', 'CLIPEncoderLayer'}, 'glide': {'ResnetBlock2D', 'CLIPEncoderLayer'}}


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_family_trains_like_ddp(family, tmp_path):
    """The latent GPT and GLIDE under FSDP2, each a wrapper around its generator and text encoder: the same losses as DDP,
    the two models' blocks as FSDP units, and an exported folder with the same weights (measured: equal for the GPT,
    5e-7 apart for GLIDE)."""
    script, args = FAMILIES[family]
    if family == 'gpt':
        from diffusers import VQModel
        torch.manual_seed(0); VQModel(**VQ).save_pretrained(tmp_path/'vq'); args = ['--vqvae', tmp_path/'vq', *args]
    common = [*args, '--max_steps', 4, '--batch_size', 4, '--checkpoint_every', 2, '--report_to', 'none']
    launch(script, '--output_dir', tmp_path/'ddp', *common, probe=tmp_path/'p_ddp')
    launch_fsdp(script, '--output_dir', tmp_path/'fsdp', *common, probe=tmp_path/'p_fsdp')
    ddp, fsdp = rank_records(tmp_path/'p_ddp', 2), rank_records(tmp_path/'p_fsdp', 2)
    assert fsdp[0]['losses'] == pytest.approx(ddp[0]['losses'], rel=1e-6, abs=1e-7)
    assert fsdp[0]['params'].numel() < 0.6 * ddp[0]['params'].numel()   # sharded
    # units: the generator's and the text encoder's own blocks inside the wrapper (`fsdp_wrap_policy` reads the parts'
    # _no_split_modules; the wrapper declares none, so accelerate's default would leave it the only unit)
    assert fsdp[0]['fsdp_units'][0] == WRAPPER[family] and BLOCKS[family] <= set(fsdp[0]['fsdp_units']), fsdp[0]['fsdp_units']
    a, b = folder_tensors(tmp_path/'ddp'/'model'), folder_tensors(tmp_path/'fsdp'/'model')
    assert a.keys() == b.keys() and max(max_diff({k: a[k]}, {k: b[k]}) for k in a) < 1e-4
    assert (tmp_path/'fsdp'/'checkpoints'/'step_00000004'/'pytorch_model_fsdp_0'/'.metadata').is_file()


def test_sharded_checkpoint_without_fsdp_is_refused_clearly(runs, shapes, tmp_path):
    "A sharded checkpoint resumed by one process (no FSDP) stops in one line that says how to resume it or export it."
    d, _, _ = runs
    res = tmp_path/'res'
    shutil.copytree(d/'fsdp', res)
    shutil.rmtree(res/'model')
    p = run([sys.executable, 'scripts/train_ldm.py', '--output_dir', str(res), '--dataset', str(shapes), *map(str, ARGS), '--max_steps', '6'], check=False)
    assert p.returncode == 2 and 'Traceback' not in p.stderr, p.stderr[-2000:]
    assert 'was written under FSDP2' in p.stderr and 'export_checkpoint.py' in p.stderr


GPT_GRPO = '''
"GRPO of a tiny latent GPT on 2 ranks (DDP or FSDP2, as launched); argv: OUTPUT_DIR. Each rank records its ratio ranges."
import json, os, sys, torch
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
class Recorded(GPTGRPO):
    seen = []
    def configure_optimizer(self, model, cfg):      # plain SGD: the update is the gradient, so the two ways of syncing compare closely
        return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    def loss(self, model, batch):
        o = super().loss(model, batch)
        self.seen.append([o['ratio_min'].item(), o['ratio_max'].item()])
        return o
torch.manual_seed(0)
vq = VQTokenizer(VQModel(block_out_channels=(16, 32, 32), down_block_types=('DownEncoderBlock2D',) * 3, up_block_types=('UpDecoderBlock2D',) * 3,
                         latent_channels=8, vq_embed_dim=8, num_vq_embeddings=16, norm_num_groups=8, sample_size=32))
cfg = GPTConfig.preset('tiny', n_layer=2, n_embd=32, n_head=2, text_hidden=32, text_layers=1, text_max_length=24, vqvae='(in memory)',
                       guidance_scale=2.0, temperature=1.0)
model = TextToImageGPT.from_config(cfg, corpus=ShapesPrompts()(200, seed=0)[0], tokenizer=vq)
task = Recorded(model, ShareOfToken0(), ShapesPrompts(), GRPOConfig(group_size=4), prompts_per_step=2, inner_steps=2)
train(task, None, TrainConfig(output_dir=sys.argv[1], max_steps=4, lr=0.5, tracker='none', checkpoint_every=None, save_model=True,
                              max_grad_norm=None, sample_every=4, n_samples=2))
with open(f"{sys.argv[1]}/seen_rank{os.environ.get('RANK', 0)}.json", 'w') as f: json.dump(task.seen, f)
'''


def gpt_grpo_matches_ddp(tmp_path, name:str):
    """GRPO of a latent GPT (GPT_GRPO) on 2 ranks under DDP and under accelerate config `name`: the ratio exactly 1 at each
    rollout's first update on each rank, DDP's ratio ranges and, after 4 SGD steps, DDP's weights to 1e-5 (the same
    rollouts: the same seeds and weights; only the reductions' rounding differs); the validation grid written."""
    from safetensors.torch import load_file
    (tmp_path/'grpo.py').write_text(GPT_GRPO)
    launch(tmp_path/'grpo.py', tmp_path/'ddp')
    launch_config(name, tmp_path/'grpo.py', tmp_path/name)
    for r in (0, 1):
        seen = json.loads((tmp_path/name/f'seen_rank{r}.json').read_text())
        assert seen[0] == [1.0, 1.0] and seen[2] == [1.0, 1.0], f"rank {r}: ratio ranges {seen} (first updates of the two rollouts must be 1)"
        ddp = json.loads((tmp_path/'ddp'/f'seen_rank{r}.json').read_text())
        assert sum(seen, []) == pytest.approx(sum(ddp, []), abs=1e-5), (seen, ddp)
    assert (tmp_path/name/'samples').is_dir(), "the validation grid (sampled outside the sharded forward on every rank) was not written"
    files = lambda d: sorted((tmp_path/d/'model').rglob('*.safetensors'))
    a, b = ({k: v for f in files(d) for k, v in load_file(str(f)).items()} for d in ('ddp', name))
    assert max_diff(a, b) < 1e-5, max_diff(a, b)


def test_grpo_under_fsdp_matches_ddp(tmp_path):
    """GRPO of a latent GPT under FSDP2 (`gpt_grpo_matches_ddp`): its rollouts call the GPT's sampler outside the sharded
    forward (they run inside `unsharded`). Without the gather the first rollout fails on a DTensor."""
    gpt_grpo_matches_ddp(tmp_path, 'fsdp2')


@pytest.mark.slow
def test_lora_grpo_under_fsdp_matches_ddp(tmp_path):
    """Slow (`--slow`: LoRA is a second variant of the GRPO test above). Latent diffusion GRPO with LoRA on the UNet, on 2 ranks under FSDP2 and under DDP (each rank its own rollout, SGD):
    ratio exactly 1 at each first update, and the saved model (adapters merged into the UNet, and the adapters alone in
    `pytorch_lora_weights.safetensors`) equal to DDP's to 1e-6. Saving merged a deep copy of the UNet, which under FSDP2
    carries its process group and cannot be copied: the run died at its first save."""
    from safetensors.torch import load_file
    from test_grpo import DIFFUSION_GRPO
    (tmp_path/'lgrpo.py').write_text(DIFFUSION_GRPO.replace('train_text_encoder=text)', 'train_text_encoder=text, lora_rank=4)'))
    launch(tmp_path/'lgrpo.py', tmp_path/'ddp', 'split')
    launch_fsdp(tmp_path/'lgrpo.py', tmp_path/'fsdp', 'split')
    for r in (0, 1):
        seen = json.loads((tmp_path/'fsdp'/f'seen_rank{r}.json').read_text())
        assert seen[0][:2] == [1.0, 1.0] and seen[1][:2] != [1.0, 1.0], f"rank {r}: ratio ranges {[s[:2] for s in seen]}"
    for f in ('unet/diffusion_pytorch_model.safetensors', 'pytorch_lora_weights.safetensors'):
        a, b = (load_file(str(tmp_path/d/'model'/f)) for d in ('ddp', 'fsdp'))
        assert max_diff(a, b) < 1e-6, (f, max_diff(a, b))
