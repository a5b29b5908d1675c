"OpenAI's GLIDE through the command line: convert, fine-tune, resume the fine-tune, write it back in OpenAI's format."
import json, sys
import torch
from conftest import ROOT, run

FX = ROOT/'tests'/'fixtures'/'glide-openai-tiny'


def test_convert_finetune_resume_and_back(tmp_path):
    model = tmp_path/'converted'
    run([sys.executable, 'scripts/convert_glide.py', '--checkpoint', str(FX/'base_tiny.pt'), '--options', str(FX/'base_tiny_options.json'),
         '--bpe_dir', str(FX), '--output_dir', str(model)])
    ft = tmp_path/'ft'
    args = [sys.executable, 'scripts/train_glide.py', '--stage', 'base', '--pretrained_model_name_or_path', str(model), '--output_dir', str(ft),
            '--dataset', 'shapes:n=8', '--train_batch_size', '2', '--report_to', 'none', '--checkpointing_steps', '1', '--validation_steps', '100']
    run(args + ['--max_train_steps', '1'])
    p = run(args + ['--max_train_steps', '2'])                      # the same command, one more step: it resumes
    assert 'step_00000001' in p.stdout + p.stderr, (p.stdout + p.stderr)[-2000:]
    info = json.loads((ft/'model'/'run_info.json').read_text())
    assert info['config']['model']['last_token_proj'] is True and info['config']['model']['text_width'] == 16   # the converted model's shape
    run([sys.executable, 'scripts/convert_glide.py', '--to_openai', '--model', str(ft/'model'), '--output', str(tmp_path/'ft.pt')])
    orig, back = torch.load(FX/'base_tiny.pt', weights_only=True), torch.load(tmp_path/'ft.pt', weights_only=True)
    assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in orig.items()}
    assert not torch.equal(back['out.2.weight'], orig['out.2.weight'])   # fine-tuned: not the file it came from


def test_converted_upsampler_finetunes_at_its_own_resolution(tmp_path):
    "The data follow the converted model's resolution (OpenAI's upsampler: 256 px; the fixture's: 32), not the flags' default, and GLIDE's conditioning stays."
    model = tmp_path/'up'
    run([sys.executable, 'scripts/convert_glide.py', '--checkpoint', str(FX/'upsample_tiny.pt'), '--options', str(FX/'upsample_tiny_options.json'),
         '--bpe_dir', str(FX), '--output_dir', str(model)])
    run([sys.executable, 'scripts/train_glide.py', '--stage', 'upsample', '--pretrained_model_name_or_path', str(model), '--output_dir', str(tmp_path/'ft'),
         '--dataset', 'shapes:n=4', '--train_batch_size', '2', '--max_train_steps', '1', '--report_to', 'none'])
    meta = json.loads((tmp_path/'ft'/'model'/'imagegen_glide.json').read_text())
    assert (meta['config']['resolution'], meta['config']['low_res'], meta['config']['glide_condition'], meta['noise_level']) == (32, 8, True, 0)
