"""GLM-Image through its real scripts: train_glm_image.py on 2 gloo CPU ranks (both stages, LoRA on the DiT, EMA: replicas
identical), exact resume in one process, bf16 LoRA over a saved base (frozen weights in bf16), the saved folder in
diffusers' GlmImagePipeline, sample.py on 2 ranks in prompt order, evaluate.py, image to image through sample.py
--shapes_edit_split, and the errors a user meets."""
import json, sys
from pathlib import Path
import pytest, torch
from conftest import assert_same_image, run, launch, rank_records, run_many

TINY = ['--dataset_name', 'shapes:n=16', '--batch_size', 2, '--report_to', 'none', '--learning_rate', '1e-3']


@pytest.fixture(scope='module')
def glm2(tmp_path_factory):
    "scripts/train_glm_image.py on 2 ranks, 4 steps, both stages (the generator in full, the DiT with LoRA), with EMA."
    d = tmp_path_factory.mktemp('glm2')
    launch('scripts/train_glm_image.py', '--output_dir', d/'run', *TINY, '--max_steps', 4, '--checkpoint_every', 2, '--train', 'both',
           '--dit_lora_rank', 4, '--use_ema', probe=d/'probe')
    return d, rank_records(d/'probe', 2)


def test_two_ranks_stay_identical(glm2):
    d, (r0, r1) = glm2
    assert (r0['world_size'], r1['world_size'], r0['end_step']) == (2, 2, 4)
    assert not torch.equal(r0['params_start'], r0['params']), "training did not change the model"
    seen = [[c for b in r['batches'] for c in b['captions']] for r in (r0, r1)]
    assert seen[0] and seen[1] and seen[0] != seen[1], seen   # each rank its own share of the data: equal weights come from the gradients' all-reduce
    torch.testing.assert_close(r0['params'], r1['params'], rtol=0, atol=0)
    torch.testing.assert_close(r0['ema'], r1['ema'], rtol=0, atol=0)
    assert len(r0['ema']) < len(r0['params'])       # the EMA holds the trained weights only, not the DiT's frozen base under LoRA
    info = json.loads((d/'run'/'model'/'run_info.json').read_text())
    assert (info['config']['model']['train'], info['config']['model']['dit_lora_rank'], info['config']['train']['ema']) == ('both', 4, True)


def test_lora_and_full_stages_under_fsdp_match_ddp(glm2, tmp_path):
    """The same run under FSDP2 (2 ranks; the generator in full, the DiT with LoRA, EMA): DDP's losses, and a saved folder
    (the adapters, and the pipeline with them merged) with DDP's tensors to 1e-5, which `GlmImagePipeline` loads. Merging
    deep-copied the DiT, and a module sharded by FSDP2 cannot be copied (it holds its process group): the save failed."""
    from diffusers import GlmImagePipeline
    from test_fsdp import folder_tensors, launch_fsdp, max_diff
    d, ddp = glm2
    launch_fsdp('scripts/train_glm_image.py', '--output_dir', tmp_path/'run', *TINY, '--max_steps', 4, '--checkpoint_every', 2,
                '--train', 'both', '--dit_lora_rank', 4, '--use_ema', probe=tmp_path/'probe')
    fsdp = rank_records(tmp_path/'probe', 2)
    # the trained stages' own blocks are FSDP units (`fsdp_wrap_policy` reads the parts' _no_split_modules: the task's
    # wrapper around the two stages declares none, and accelerate's default would leave the root as the only unit)
    assert {'GlmImageTransformerBlock', 'GlmImageTextDecoderLayer'} <= set(fsdp[0]['fsdp_units']), fsdp[0]['fsdp_units']
    assert fsdp[0]['losses'] == pytest.approx(ddp[0]['losses'], rel=1e-5, abs=1e-6), (fsdp[0]['losses'], ddp[0]['losses'])
    a, b = folder_tensors(d/'run'/'model'), folder_tensors(tmp_path/'run'/'model')
    assert a.keys() == b.keys() and any('transformer_lora' in k for k in a), sorted(a)[:5]
    assert max_diff(a, b) < 1e-5, max_diff(a, b)
    assert type(GlmImagePipeline.from_pretrained(tmp_path/'run'/'model').transformer).__name__ == 'GlmImageTransformer2DModel'   # its own class, not FSDP's


def test_resume_is_exact(tmp_path):
    "4 steps at once, or 2 steps and a resume to 4 (a constant learning rate: the schedule does not depend on --max_steps): the same weights, bit for bit."
    args = [*TINY, '--train', 'both', '--checkpoint_every', 2, '--lr_scheduler', 'constant', '--warmup_steps', 0]
    launch('scripts/train_glm_image.py', '--output_dir', tmp_path/'once', *args, '--max_steps', 4, num_processes=1, probe=tmp_path/'p_once')
    launch('scripts/train_glm_image.py', '--output_dir', tmp_path/'twice', *args, '--max_steps', 2, num_processes=1, probe=tmp_path/'p_a')
    launch('scripts/train_glm_image.py', '--output_dir', tmp_path/'twice', *args, '--max_steps', 4, '--resume_from_checkpoint', 'latest',
           num_processes=1, probe=tmp_path/'p_b')
    once, first, second = (rank_records(tmp_path/p, 1)[0] for p in ('p_once', 'p_a', 'p_b'))
    assert second['start_step'] == 2 and second['resumed_from'] and second['end_step'] == 4
    torch.testing.assert_close(second['params_start'], first['params'], rtol=0, atol=0)
    torch.testing.assert_close(second['params'], once['params'], rtol=0, atol=0)


def test_folder_loads_in_the_pipeline_and_samples_on_two_ranks(glm2, tmp_path):
    from diffusers import GlmImagePipeline
    from imagegen.models import load_model
    d, _ = glm2
    folder = d/'run'/'model'
    m = load_model(folder)
    pipe = GlmImagePipeline.from_pretrained(folder)     # over a base built from nothing: the LoRA merged into the saved pipeline
    theirs = pipe(prompt=['a red circle'], height=64, width=64, num_inference_steps=2, guidance_scale=1.5,
                  generator=torch.Generator().manual_seed(3), output_type='pt').images
    torch.testing.assert_close(m.generate(['a red circle'], num_inference_steps=2, seed=3), theirs * 2 - 1, rtol=0, atol=1e-4)
    args = ['--model', folder, '--shapes_split', 'test', '--n', 3, '--steps', 2, '--batch_size', 2]
    launch('scripts/sample.py', *args, '--out', tmp_path/'two')
    run([sys.executable, 'scripts/sample.py', *map(str, args), '--batch_size', '1', '--out', str(tmp_path/'one')])
    rows = [json.loads(l) for l in (tmp_path/'one'/'samples.jsonl').read_text().splitlines()]
    assert len(rows) == 3 and rows[0]['family'] == 'glm' and rows[0]['steps'] == 2
    for r in rows:   # seed i gives image i, on 1 or 2 ranks, in batches of 1 or 2
        assert_same_image(tmp_path/'one'/r['file_name'], tmp_path/'two'/r['file_name'])
    run([sys.executable, 'scripts/evaluate.py', '--samples', str(tmp_path/'one'), '--feature', 'random', '--log_to_run', 'false'])
    assert json.loads((tmp_path/'one'/'metrics.json').read_text())['oracle/n'] == 3


def test_bf16_keeps_the_frozen_weights_in_bf16_and_its_adapters_load(tmp_path):
    """--mixed_precision bf16 over a saved base with LoRA on both stages (what users run on the release): the base loads in
    bf16 and its frozen weights stay so (diffusers' `weight_dtype`: the release's 17.7B in 33 GiB, not 66), the adapters
    train in float32, and the saved adapters go onto the base in GlmImagePipeline as our loader puts them. A model built
    here (in float32) gets its frozen weights in bf16 from the loop."""
    from diffusers import GlmImagePipeline
    from imagegen.glm.build import build_glm_image, fix_image_to_image
    from imagegen.glm.task import AR_LORA_DIR, DIT_LORA_DIR, GlmImage
    build_glm_image('tiny', seed=1).save_pretrained(tmp_path/'base')
    launch('scripts/train_glm_image.py', '--output_dir', tmp_path/'run', *TINY, '--max_steps', 2, '--pretrained_model_name_or_path', tmp_path/'base',
           '--ar_lora_rank', 4, '--dit_lora_rank', 4, '--mixed_precision', 'bf16', num_processes=1, probe=tmp_path/'probe')
    # and a model built here (loaded in nothing: the loop's `cast_frozen` alone), the DiT in full
    launch('scripts/train_glm_image.py', '--output_dir', tmp_path/'built', *TINY, '--max_steps', 1, '--warmup_steps', 0, '--train', 'dit', '--mixed_precision', 'bf16',
           num_processes=1, probe=tmp_path/'probe_built')
    for rec in (rank_records(tmp_path/'probe', 1)[0], rank_records(tmp_path/'probe_built', 1)[0]):
        assert (rec['frozen_dtypes'], rec['param_dtypes']) == (['torch.bfloat16'], ['torch.float32']), (rec['frozen_dtypes'], rec['param_dtypes'])
        assert not torch.equal(rec['params_start'], rec['params'])
    folder = tmp_path/'run'/'model'
    assert not (folder/'model_index.json').exists() and (folder/AR_LORA_DIR).is_dir() and (folder/DIT_LORA_DIR).is_dir()
    pipe = fix_image_to_image(GlmImagePipeline.from_pretrained(tmp_path/'base'))
    pipe.vision_language_encoder.load_adapter(str(folder/AR_LORA_DIR))
    pipe.transformer.load_lora_adapter(str(folder/DIT_LORA_DIR), prefix=None, use_safetensors=True)
    gen = lambda p: p(prompt=['a red circle'], height=64, width=64, num_inference_steps=2, generator=torch.Generator().manual_seed(3), output_type='pt').images
    torch.testing.assert_close(gen(pipe), gen(GlmImage.from_pretrained(folder).pipe), rtol=0, atol=1e-5)


def test_image_to_image_samples_as_an_editor(tmp_path):
    launch('scripts/train_glm_image.py', '--output_dir', tmp_path/'run', *TINY, '--max_steps', 1, '--mode', 'i2i', '--train', 'dit',
           num_processes=1)
    run([sys.executable, 'scripts/sample.py', '--model', str(tmp_path/'run'/'model'), '--shapes_edit_split', 'test', '--n', '2',
         '--steps', '2', '--out', str(tmp_path/'edits')])
    rows = [json.loads(l) for l in (tmp_path/'edits'/'samples.jsonl').read_text().splitlines()]
    assert len(rows) == 2 and rows[0]['family'] == 'glm-edit' and 'edit' in rows[0] and (tmp_path/'edits'/rows[0]['source_file_name']).is_file()
    run([sys.executable, 'scripts/evaluate.py', '--samples', str(tmp_path/'edits'), '--feature', 'random', '--log_to_run', 'false'])


def test_user_errors_are_one_line(glm2, tmp_path):
    d, _ = glm2
    calls = [('scripts/train_glm_image.py', ['--resolution', 48, '--output_dir', tmp_path/'a']),
             ('scripts/train_glm_image.py', ['--train', 'vq', '--output_dir', tmp_path/'b']),
             ('scripts/train_glm_image.py', ['--pretrained_model_name_or_path', tmp_path/'nothing', '--output_dir', tmp_path/'c']),
             ('scripts/sample.py', ['--model', d/'run'/'model', '--sampler', 'ddim', '--prompts', 'a red circle', '--out', tmp_path/'d'])]
    res = run_many(calls)
    for (script, argv), r, want in zip(calls, res, ['multiple of 32', "choose 'ar'", 'does not exist', '--sampler']):
        assert r['returncode'] == 2, (argv, r)
        err = r['stderr'].strip().splitlines()
        assert want in err[-1] and 'Traceback' not in r['stderr'], (argv, r['stderr'][-2000:])
