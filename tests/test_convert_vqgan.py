"""scripts/convert_vqgan.py on the taming-made fixture (tests/fixtures/vqgan-taming-tiny): the converted VQModel gives
taming's codes and pixels, scripts/train_vqvae.py fine-tunes it and scripts/train_gpt.py trains over that, filed as a pretrained (taming) VQ model, and the inputs a
user gets wrong (a config that does not match the checkpoint, a Flax port as --vqvae) are one line each."""
import json, sys
import torch
from conftest import ROOT, run, run_many

FIXTURE = ROOT/'tests'/'fixtures'/'vqgan-taming-tiny'


def test_convert_then_train_gpt(tmp_path):
    from imagegen.autoencoders.vq import VQTokenizer
    cfg = json.loads((FIXTURE/'vqgan_tiny_config.json').read_text())
    cfg['ddconfig']['attn_resolutions'] = []                                      # not the config this checkpoint was trained with
    (tmp_path/'noattn.json').write_text(json.dumps(cfg))
    flax = tmp_path/'flax'; flax.mkdir()                                          # dalle-mini's layout: config.json naming no class, msgpack
    (flax/'config.json').write_text('{"embed_dim": 256, "n_embed": 16384}'); (flax/'flax_model.msgpack').write_bytes(b'')
    convert = ['--checkpoint', FIXTURE/'vqgan_tiny.ckpt', '--output_dir']
    ok, mismatched, flax_vq, not_vq = run_many([   # one interpreter: the conversion and three refusals (training gets its own process below)
        ('scripts/convert_vqgan.py', [*convert, tmp_path/'vqgan', '--config', FIXTURE/'vqgan_tiny_config.json']),
        ('scripts/convert_vqgan.py', [*convert, tmp_path/'x', '--config', tmp_path/'noattn.json']),
        ('scripts/train_gpt.py', ['--vqvae', flax, '--output_dir', tmp_path/'g', '--report_to', 'none']),
        ('scripts/train_vqvae.py', ['--pretrained_model_name_or_path', FIXTURE, '--output_dir', tmp_path/'v', '--report_to', 'none'])])
    assert ok['returncode'] == 0 and 'left out 2 tensors of the training loss: loss.discriminator.* (1), loss.logvar' in ok['stdout'], ok
    error = lambda r: [l for l in r['stderr'].splitlines() if ': error: ' in l]
    assert mismatched['returncode'] == 2 and 'Traceback' not in mismatched['stderr'] and len(error(mismatched)) == 1, mismatched['stderr'][-2000:]
    assert 'encoder.down.2.attn.0' in error(mismatched)[0] and not (tmp_path/'x').exists()
    assert flax_vq['returncode'] == 2 and 'Traceback' not in flax_vq['stderr'] and len(error(flax_vq)) == 1, flax_vq['stderr'][-2000:]
    assert 'Flax' in error(flax_vq)[0] and 'convert_vqgan.py' in error(flax_vq)[0]
    assert not_vq['returncode'] == 2 and 'vqgan_tiny.ckpt is a taming (Lightning) checkpoint: convert it first' in error(not_vq)[0], not_vq['stderr'][-2000:]   # a .ckpt folder: convert first

    io = torch.load(FIXTURE/'vqgan_tiny_io.pt', map_location='cpu', weights_only=True)
    tok = VQTokenizer.from_pretrained(tmp_path/'vqgan')
    assert torch.equal(tok.encode(io['images']), io['codes_of_images'])
    torch.testing.assert_close(tok.decode(io['codes']), io['decoded'], rtol=0, atol=1e-5)
    torch.testing.assert_close(tok.decode(io['codes_of_images']), io['reconstructions'], rtol=0, atol=1e-5)

    # phase 1 on a user's data: fine-tune the converted VQGAN (its own quantiser and shape), then the GPT over it
    run([sys.executable, 'scripts/train_vqvae.py', '--pretrained_model_name_or_path', str(tmp_path/'vqgan'), '--output_dir', str(tmp_path/'ft'),
         '--dataset', 'shapes:n=8', '--max_train_steps', '2', '--train_batch_size', '4', '--report_to', 'none'])
    ft = json.loads((tmp_path/'ft'/'model'/'run_info.json').read_text())
    assert (ft['config']['model']['quantizer'], ft['config']['model']['codebook_size'], ft['config']['train']['tags']['vqvae_source']) == \
        ('vqmodel', 64, 'pretrained_taming')                                   # the folder's shape and quantiser
    assert json.loads((tmp_path/'ft'/'model'/'imagegen_vq.json').read_text())['fine_tuned_from'] == str(tmp_path/'vqgan')
    assert not torch.equal(VQTokenizer.from_pretrained(tmp_path/'ft'/'model').code_vectors, tok.code_vectors)   # it trained, codebook too
    run([sys.executable, 'scripts/train_gpt.py', '--vqvae', str(tmp_path/'ft'/'model'), '--output_dir', str(tmp_path/'gpt'),
         '--dataset', 'shapes:n=8', '--max_train_steps', '2', '--batch_size', '4', '--n_layer', '1', '--n_embd', '32', '--n_head', '2',
         '--text_hidden', '32', '--text_layers', '1', '--n_samples', '1', '--report_to', 'none'])
    info = json.loads((tmp_path/'gpt'/'model'/'run_info.json').read_text())
    assert (info['model_info']['vqvae_source'], info['model_info']['codebook_size']) == ('pretrained_taming', 64)
    train = info['config']['train']
    assert (train['experiment'], train['tags']['vqvae_source'], train['tags']['phase']) == ('latent-gpt-pretrained-vqvae', 'pretrained_taming', 'pretrained-vqvae')
