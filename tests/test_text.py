"Text encoder wrapper: tokenizer, shapes, determinism, cache, save/load in the pipeline layout."
import pytest, torch
from imagegen.text import TextEncoder, train_clip_tokenizer

CORPUS = ["a red circle", "a blue square at the top left", "two green triangles", "a small yellow star"] * 3

@pytest.fixture(scope='module')
def te(): return TextEncoder.tiny(CORPUS, hidden=32, layers=1, heads=2, max_length=10, vocab_size=600)

def test_tokenizer_is_clip_and_deterministic():
    t1, t2 = train_clip_tokenizer(CORPUS, 600, 10), train_clip_tokenizer(CORPUS, 600, 10)
    assert type(t1).__name__ == 'CLIPTokenizer' and t1.get_vocab() == t2.get_vocab()
    ids = t1(["a red circle"]).input_ids[0]
    assert t1.convert_ids_to_tokens(ids) == ['<|startoftext|>', 'a</w>', 'red</w>', 'circle</w>', '<|endoftext|>']

def test_shapes_and_determinism(te):
    e = te.encode(["a red circle", "two green triangles", ""])
    assert e.shape == (3, 10, 32) and e.dtype == torch.float32 and te.hidden_size == 32
    other = TextEncoder.tiny(CORPUS, hidden=32, layers=1, heads=2, max_length=10, vocab_size=600)
    torch.testing.assert_close(other.encode(["a red circle"]), e[:1])
    assert not torch.allclose(e[0], e[1])

def test_cache_hits_and_bound(te):
    te.clear_cache(); te.cache_size = 2
    a = te.encode(["a red circle"]); b = te.encode(["a red circle", "a red circle"])
    assert (te.hits, te.misses) == (2, 1)
    torch.testing.assert_close(b[0], a[0]); torch.testing.assert_close(b[1], a[0])
    assert b.data_ptr() != a.data_ptr()
    a.mul_(0); torch.testing.assert_close(te.encode(["a red circle"])[0], b[0])  # cache not aliased with results
    te.encode(["two green triangles"]); te.encode(["a small yellow star"])
    assert len(te._cache) == 2 and "a red circle" not in te._cache and te.misses == 3
    # cached values equal uncached computation
    torch.testing.assert_close(te.encode(["a small yellow star"])[0], te(te.tokenize(["a small yellow star"]))[0])

def test_empty_embedding(te):
    e = te.empty_embedding(2)
    assert e.shape == (2, 10, 32)
    torch.testing.assert_close(e[0], te(te.tokenize([""]))[0].float())

def test_trainable_bypasses_cache():
    t = TextEncoder.tiny(CORPUS, hidden=32, layers=1, heads=2, max_length=10, vocab_size=600, trainable=True)
    t.encode(["a red circle"]).pow(2).sum().backward()
    assert len(t._cache) == 0 and t.model.get_input_embeddings().weight.grad is not None

def test_save_load_and_pipeline_tokenizer(te, tmp_path):
    te.save_pretrained(tmp_path)
    back = TextEncoder.from_pretrained(tmp_path)
    torch.testing.assert_close(back.encode(["a blue square at the top left"]), te.encode(["a blue square at the top left"]))
    from transformers import CLIPTokenizer, CLIPTextModel
    tok = CLIPTokenizer.from_pretrained(tmp_path, subfolder='tokenizer')   # what StableDiffusionPipeline does
    assert tok.model_max_length == 10
    m = CLIPTextModel.from_pretrained(tmp_path, subfolder='text_encoder')
    ids = tok(["a red circle"], padding='max_length', max_length=tok.model_max_length, return_tensors='pt').input_ids
    torch.testing.assert_close(m(ids)[0], te.encode(["a red circle"]))
    with pytest.raises(ValueError, match='layout'): TextEncoder.from_pretrained(tmp_path, layout='bad')
