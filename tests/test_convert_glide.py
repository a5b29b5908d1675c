"OpenAI's GLIDE through the command line: convert base and upsampler, fine-tune each (the base resumed too), write the base back in OpenAI's format."
import json, sys
import torch
from conftest import ROOT, run, run_many

FX = ROOT/'tests'/'fixtures'/'glide-openai-tiny'


def test_convert_finetune_resume_and_back(tmp_path):
    model, up = tmp_path/'converted', tmp_path/'up'
    conv = run_many([('scripts/convert_glide.py', ['--checkpoint', FX/f'{n}_tiny.pt', '--options', FX/f'{n}_tiny_options.json', '--bpe_dir', FX,
                                                    '--output_dir', out]) for n, out in (('base', model), ('upsample', up))])
    assert [c['returncode'] for c in conv] == [0, 0], conv
    assert 'a GLIDE base folder' in conv[0]['stdout'] and 'a GLIDE upsample folder' in conv[1]['stdout']
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

    # the upsampler: the data follow the converted model's resolution (OpenAI's: 256 px; the fixture's: 32), not the flags'
    # default, and GLIDE's conditioning stays
    run([sys.executable, 'scripts/train_glide.py', '--stage', 'upsample', '--pretrained_model_name_or_path', str(up), '--output_dir', str(tmp_path/'upft'),
         '--dataset', 'shapes:n=4', '--train_batch_size', '2', '--max_train_steps', '1', '--report_to', 'none'])
    meta = json.loads((tmp_path/'upft'/'model'/'imagegen_glide.json').read_text())
    assert (meta['config']['resolution'], meta['config']['low_res'], meta['config']['glide_condition'], meta['noise_level']) == (32, 8, True, 0)
