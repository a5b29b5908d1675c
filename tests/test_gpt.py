"""The latent GPT family through its real scripts: train_gpt.py on 2 gloo CPU ranks (replicas, text encoder and
tokenizer identical; only rank 0 writes), sample.py on 2 ranks in prompt order, evaluate.py with the VQ model's
ceiling, and the command-line errors a user meets (a folder of the other family, a misspelt flag)."""
import json, sys
from pathlib import Path
import pytest, torch
from conftest import assert_same_image, ROOT, run, launch, rank_records


@pytest.fixture(scope='module')
def vq(tmp_path_factory):
    "A random diffusers VQModel folder (64 codes, 8x8 tokens at 32 px): the frozen first stage the GPT is trained on."
    from diffusers import VQModel
    d = tmp_path_factory.mktemp('vq')/'vq'
    torch.manual_seed(0)
    VQModel(block_out_channels=(16, 32, 32), down_block_types=('DownEncoderBlock2D',) * 3, up_block_types=('UpDecoderBlock2D',) * 3,
            latent_channels=8, vq_embed_dim=8, num_vq_embeddings=64, norm_num_groups=8, sample_size=32).save_pretrained(d)
    return d


GPT_ARGS = ['--dataset', 'shapes:n=32', '--max_steps', 4, '--batch_size', 4, '--n_layer', 1, '--n_embd', 32, '--n_head', 2,
            '--text_hidden', 32, '--text_layers', 1, '--train_text_encoder', '--checkpoint_every', 2, '--report_to', 'none']


@pytest.fixture(scope='module')
def gpt2(vq, tmp_path_factory):
    "scripts/train_gpt.py on 2 ranks, 4 steps, a trained tiny text encoder, cached tokens."
    d = tmp_path_factory.mktemp('gpt2')
    launch('scripts/train_gpt.py', '--vqvae', vq, '--output_dir', d/'run', *GPT_ARGS, probe=d/'probe')
    return d/'run', rank_records(d/'probe', 2)


def test_two_ranks_stay_identical(gpt2):
    run_dir, (r0, r1) = gpt2
    assert (r0['world_size'], r1['world_size'], r0['end_step']) == (2, 2, 4)
    assert not torch.equal(r0['params_start'], r0['params']), "training did not change the transformer"
    torch.testing.assert_close(r0['params'], r1['params'], rtol=0, atol=0)
    torch.testing.assert_close(r0['text_params'], r1['text_params'], rtol=0, atol=0)
    assert r0['vocab'] == r1['vocab']                        # one tokenizer corpus on both ranks
    k0 = [k for b in r0['batches'] for k in b['keys']]; k1 = [k for b in r1['batches'] for k in b['keys']]
    assert not set(k0[:16]) & set(k1[:16])                   # the ranks read different samples of the first epoch
    own = lambda p: Path(p).name.startswith('random_states_1') or (Path(p).name.startswith('part-00001.')   # its share of the
                                                                   and (run_dir/'encoded') in Path(p).parents)   # token cache
    assert not [p for _, p in r1['writes'] if not own(p)]     # rank 1 writes nothing else
    assert {Path(p).name for _, p in r1['writes'] if 'encoded' in p} == {'part-00001.tokens.npy', 'part-00001.json'}
    info = json.loads((run_dir/'model'/'run_info.json').read_text())
    assert (info['model_info']['codebook_size'], info['config']['train']['experiment']) == (64, 'latent-gpt-pretrained-vqvae')



def test_codebook_head_through_the_scripts(vq, tmp_path):
    "The main recipe's head (`--output_head codebook`): trained, saved with the VQ model's code vectors, reloaded and sampled."
    from imagegen.ar.task import TextToImageGPT
    from imagegen.autoencoders.vq import VQTokenizer
    run([sys.executable, 'scripts/train_gpt.py', '--vqvae', str(vq), '--output_dir', str(tmp_path/'run'),
         *map(str, GPT_ARGS), '--max_steps', '2', '--output_head', 'codebook'])
    m = TextToImageGPT.from_pretrained(tmp_path/'run'/'model')
    assert m.gpt.config.output_head == 'codebook' and torch.equal(m.gpt.lm_head.code_vectors, VQTokenizer.from_pretrained(vq).code_vectors)
    assert m.gpt.lm_head.bias.abs().sum() > 0                 # trained: the per-code bias moved from zero
    run([sys.executable, 'scripts/sample.py', '--model', str(tmp_path/'run'/'model'), '--shapes_split', 'test', '--n', '2', '--out', str(tmp_path/'s')])
    assert len((tmp_path/'s'/'samples.jsonl').read_text().splitlines()) == 2


def test_sample_and_evaluate_on_two_ranks(gpt2, tmp_path):
    run_dir, _ = gpt2
    launch('scripts/sample.py', '--model', run_dir/'model', '--shapes_split', 'test', '--n', 5, '--batch_size', 2, '--top_k', 16,
           '--out', tmp_path/'two')
    run([sys.executable, 'scripts/sample.py', '--model', str(run_dir/'model'), '--shapes_split', 'test', '--n', '5', '--top_k', '16',
         '--out', str(tmp_path/'one')])
    two = [json.loads(l) for l in (tmp_path/'two'/'samples.jsonl').read_text().splitlines()]
    one = [json.loads(l) for l in (tmp_path/'one'/'samples.jsonl').read_text().splitlines()]
    assert [r['prompt'] for r in two] == [r['prompt'] for r in one] and two[0]['family'] == 'gpt'
    for r in one:   # seed i gives image i, on 1 or 2 ranks, in any batch
        assert_same_image(tmp_path/'one'/r['file_name'], tmp_path/'two'/r['file_name'])
    p = run([sys.executable, 'scripts/evaluate.py', '--samples', str(tmp_path/'one'), '--feature', 'random', '--log_to_run', 'false'])
    m = json.loads((tmp_path/'one'/'metrics.json').read_text())
    assert m['first_stage/n'] == 5 and 'vqvae reconstructions' in p.stdout and m['family'] == 'gpt'


def test_user_errors_are_one_line(vq, gpt2, tmp_path):
    "Refused inputs, each run as its script's __main__ in one interpreter (conftest.run_many): exit 2, one line, no traceback."
    from conftest import run_many
    run_dir, _ = gpt2
    wrong_vq, not_a_model, abbreviated = run_many([
        ('scripts/train_gpt.py', ['--vqvae', run_dir/'model', '--output_dir', tmp_path/'x', *GPT_ARGS]),   # a latent GPT folder is not a VQ model
        ('scripts/sample.py', ['--model', vq, '--prompts', 'a red circle']),
        ('scripts/sample.py', ['--model', run_dir/'model', '--prompt', 'a red circle'])])
    assert wrong_vq['returncode'] == 2 and 'Traceback' not in wrong_vq['stderr'] and 'VQ' in wrong_vq['stderr'], wrong_vq['stderr'][-2000:]
    assert not_a_model['returncode'] == 2 and 'a VQ-VAE alone' in not_a_model['stderr'] and 'Traceback' not in not_a_model['stderr'], not_a_model['stderr'][-2000:]
    assert abbreviated['returncode'] == 2 and 'unrecognized arguments: --prompt' in abbreviated['stderr']     # no prefix abbreviations
