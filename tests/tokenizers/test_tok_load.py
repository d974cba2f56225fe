"""Auto-detection, forced kinds, Megatron aliases, clear errors, and the file-less backends."""

import json

import numpy as np
import pytest
from tok_helpers import TOK, load_shared, needs_shared

from tokenloom.errors import TokenloomError
from tokenloom.tokenizers import TokenizerSpec, detect_kind, list_kinds, load_tokenizer
from tokenloom.tokenizers.load import check_megatron_type


def test_list_kinds():
    assert set(list_kinds()) == {"hf", "gpt2-bpe", "wordpiece", "sentencepiece", "tiktoken", "byte", "null"}


@needs_shared
@pytest.mark.parametrize("path, kind, vocab_size, eod", [
    ("gpt2", "gpt2-bpe", 50257, 50256),
    ("gpt2/gpt2-vocab.json", "gpt2-bpe", 50257, 50256),
    ("gpt2/gpt2-merges.txt", "gpt2-bpe", 50257, 50256),
    ("gpt2/gpt2.tiktoken", "tiktoken", 50257, 50256),
    ("gpt-neox-20b", "hf", 50277, 0),
    ("gpt-neox-20b/tokenizer.json", "hf", 50277, 0),
    ("llama2", "sentencepiece", 32000, 2),
    ("llama2/tokenizer.model", "sentencepiece", 32000, 2),
    ("mistral-v3/tokenizer.model", "sentencepiece", 32768, 2),
    ("llama3", "tiktoken", 128256, 128001),  # tokenizer.model that is really tiktoken ranks
    ("llama3/tokenizer.model", "tiktoken", 128256, 128001),
    ("qwen2", "gpt2-bpe", 151646, 151643),
])
def test_autodetect_shared(path, kind, vocab_size, eod):
    assert detect_kind(TOK / path) == kind
    tok = load_shared(path)
    assert (tok.kind, tok.vocab_size, tok.eod) == (kind, vocab_size, eod)
    ids = tok.encode("Hello world, this is a test.")
    assert ids.dtype in (np.int64, np.uint32) and 0 < len(ids) and int(ids.max()) < tok.vocab_size


@needs_shared
def test_sentencepiece_specials():
    tok = load_shared("llama2")
    assert (tok.bos, tok.eod, tok.pad) == (1, 2, None)
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


@needs_shared
def test_forced_kind_and_aliases(shared_verdicts):
    """A forced kind or Megatron alias loads that kind (the session's self-check verdicts: the
    files are the ones auto-detection loads); a kind the file is not is one line."""
    assert load_tokenizer(TOK / "gpt2", kind="gpt2-bpe").kind == "gpt2-bpe"
    assert load_tokenizer(TOK / "gpt2" / "gpt2.tiktoken", kind="TikTokenizer").kind == "tiktoken"
    assert load_tokenizer(TOK / "llama2", kind="Llama2Tokenizer").kind == "sentencepiece"
    assert load_tokenizer(TOK / "gpt-neox-20b", kind="HuggingFaceTokenizer").kind == "hf"
    with pytest.raises(TokenloomError, match="not a valid SentencePiece model"):
        load_tokenizer(TOK / "llama3" / "tokenizer.model", kind="sentencepiece")


def test_missing_path(tmp_path):
    with pytest.raises(TokenloomError, match="does not exist"):
        load_tokenizer(tmp_path / "nope.json")


def test_unknown_kind(tmp_path):
    with pytest.raises(TokenloomError, match="unknown tokenizer kind 'bogus'.*known kinds"):
        load_tokenizer(tmp_path, kind="bogus")


def test_nothing_given():
    with pytest.raises(TokenloomError, match="no tokenizer given"):
        load_tokenizer()


@pytest.mark.parametrize("name, content, match", [
    ("tokenizer.model", bytes(range(256)) * 4, "not a valid SentencePiece model"),
    ("junk.bin", b"\x00\x01garbage\xff\xfe" * 10, "not a valid SentencePiece model"),
    ("notes.txt", b"hello there world\nsome free text, three words or more\n", "unrecognised tokenizer file"),
    ("empty.json", b"", "empty file"),
    ("broken.json", b'{"model": {', "does not parse"),
    ("list.json", b"[1, 2, 3]", "neither a Hugging Face tokenizer.json nor a vocab.json"),
    ("tokenizer.json", b'{"version": "1.0", "model": {"type": "Nope"}}', "not a valid Hugging Face"),
])
def test_garbage_files(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(TokenloomError, match=match) as err:
        load_tokenizer(path)
    assert name in str(err.value)


def test_empty_directory(tmp_path):
    with pytest.raises(TokenloomError, match="no tokenizer found"):
        load_tokenizer(tmp_path)


def test_vocab_without_merges(tmp_path):
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    with pytest.raises(TokenloomError, match="needs vocab.json and merges.txt"):
        load_tokenizer(tmp_path / "vocab.json")


def test_bad_merges_line(tmp_path):
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\nthis line is wrong\n")
    with pytest.raises(TokenloomError, match=r"merges.txt:2: not a BPE merge line"):
        load_tokenizer(tmp_path)


def test_unsupported_tokenizer_class(tmp_path):
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2}))
    (tmp_path / "merges.txt").write_text("a b\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "FancyTokenizer"}))
    with pytest.raises(TokenloomError, match="tokenizer_class 'FancyTokenizer' is not supported"):
        load_tokenizer(tmp_path)
    assert load_tokenizer(tmp_path, pretokenizer="gpt2").kind == "gpt2-bpe"


def test_unknown_tiktoken_file_needs_pattern(tmp_path):
    import base64

    path = tmp_path / "mine.tiktoken"
    path.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    with pytest.raises(TokenloomError, match="unknown tiktoken rank file.*pass pattern="):
        load_tokenizer(path)
    tok = load_tokenizer(path, pattern="llama3", special_tokens=["<|endoftext|>", "<|pad|>"], pad="<|pad|>")
    assert (tok.vocab_size, tok.eod, tok.pad) == (258, 256, 257)
    assert list(tok.encode("hi")) == [104, 105]
    with pytest.raises(TokenloomError, match="unknown tiktoken options"):
        load_tokenizer(path, pattern="llama3", colour="blue")


def test_bad_option_is_an_error(tmp_path, wordpiece_vocab):
    with pytest.raises(TokenloomError, match=r"unknown wordpiece tokenizer options \['frobnicate'\]"):
        load_tokenizer(wordpiece_vocab, frobnicate=1)
    with pytest.raises(TokenloomError, match="eod id 500 is outside the vocabulary"):
        load_tokenizer(wordpiece_vocab, eod=500)
    with pytest.raises(TokenloomError, match="eod token 'nope' is not in the vocabulary"):
        load_tokenizer(wordpiece_vocab, eod="nope")
    assert load_tokenizer(wordpiece_vocab, eod="[CLS]").eod == 2


def test_wordpiece_lowercase(wordpiece_vocab):
    tok = load_tokenizer(wordpiece_vocab.parent)
    assert tok.kind == "wordpiece" and tok.lowercase
    assert (tok.eod, tok.bos, tok.pad, tok.vocab_size) == (3, 2, 0, 21)
    words = [tok.decode([i]) for i in tok.encode("The cats sat!")]
    assert words == ["the", "cat", "##s", "sat", "!"]  # no [CLS]/[SEP] added
    assert tok.decode(tok.encode("The cats sat!")) == "the cats sat!"
    assert list(tok.encode("zzz")) == [1]  # [UNK]


def test_wordpiece_cased(tmp_path, wordpiece_vocab):
    cased = tmp_path / "cased"
    cased.mkdir()
    (cased / "vocab.txt").write_text(wordpiece_vocab.read_text() + "The\n")
    tok = load_tokenizer(cased / "vocab.txt")
    assert not tok.lowercase
    assert list(tok.encode("The the")) == [21, 5]
    lower = load_tokenizer(cased, kind="BertWordPieceLowerCase")
    assert lower.lowercase and list(lower.encode("The the")) == [5, 5]
    assert lower.fingerprint()["digest"] != tok.fingerprint()["digest"]


def test_byte_tokenizer():
    tok = load_tokenizer(kind="byte")
    ids, lengths = tok.encode_batch(["hé", "", "x"])
    assert list(ids) == [104, 195, 169, 120] and list(lengths) == [3, 0, 1]
    assert (tok.eod, tok.bos, tok.pad, tok.vocab_size) == (256, 257, 258, 259)
    assert tok.decode([104, 256, 195, 169]) == "hé"


def test_null_tokenizer():
    tok = load_tokenizer(kind="null", vocab_size=100)
    ids, lengths = tok.encode_batch(["1 2  3\n", "", "99"])
    assert list(ids) == [1, 2, 3, 99] and list(lengths) == [3, 0, 1]
    assert (tok.eod, tok.vocab_size) == (100, 101)
    assert tok.decode([1, 2, 100]) == "1 2"
    with pytest.raises(TokenloomError, match="out of range"):
        tok.encode("100")
    with pytest.raises(TokenloomError, match="whitespace-separated integers"):
        tok.encode("one two")
    default = load_tokenizer(kind="NullTokenizer")
    assert default.vocab_size - 1 == default.eod <= 2**31 - 1
    with pytest.raises(TokenloomError, match="takes no file"):
        load_tokenizer("somewhere", kind="null")


def test_threads_env(monkeypatch):
    from tokenloom.tokenizers.base import THREADS_ENV, resolve_threads

    monkeypatch.setenv(THREADS_ENV, "1")
    assert resolve_threads(None) == 1 and resolve_threads(3) == 3
    monkeypatch.setenv(THREADS_ENV, "many")
    with pytest.raises(TokenloomError, match="not an integer"):
        resolve_threads(None)
    monkeypatch.delenv(THREADS_ENV)
    assert resolve_threads(None) is None
    with pytest.raises(TokenloomError, match="num_threads must be >= 1"):
        resolve_threads(0)


def test_load_from_tokenizer_and_spec():
    tok = load_tokenizer(kind="null", vocab_size=5)
    assert load_tokenizer(tok) is tok
    assert load_tokenizer(tok.spec).fingerprint() == tok.fingerprint()
    assert load_tokenizer(tok, vocab_size=6).eod == 6
    with pytest.raises(TokenloomError, match="conflicts with the spec's kind"):
        load_tokenizer(tok.spec, kind="byte")


@needs_shared
@pytest.mark.parametrize("path", ["gpt2", "gpt-neox-20b", "llama2", "gpt2/gpt2.tiktoken"])
def test_single_threaded_copy(path):
    """What forked preprocess workers use: same ids, one thread, the original untouched."""
    tok = load_shared(path, num_threads=2)
    one = tok.single_threaded()
    assert type(one) is type(tok) and one.spec.options["num_threads"] == 1
    assert one.num_threads == 1 and tok.num_threads == 2 and tok.spec.options["num_threads"] == 2
    texts = ["Hello world", "", "a<|endoftext|>b \u00e9\u4e2d"]
    for got, want in zip(one.encode_batch(texts), tok.encode_batch(texts), strict=True):
        np.testing.assert_array_equal(got, want)
    assert one.fingerprint()["digest"] == tok.fingerprint()["digest"]


def test_single_threaded_byte_tokenizer():
    tok = load_tokenizer(None, kind="byte")
    np.testing.assert_array_equal(tok.single_threaded().encode("ab"), tok.encode("ab"))


def _hf_view(path) -> dict:
    """What ``tokenizers`` itself says of a tokenizer.json: vocabulary size, added tokens in id order."""
    import tokenizers

    tk = tokenizers.Tokenizer.from_file(str(path))
    return {"vocab_size": max(tk.get_vocab(with_added_tokens=True).values()) + 1,
            "added": [t.content for _, t in sorted(tk.get_added_tokens_decoder().items())]}


def _small_bpe(tmp_path, specials):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tokenloom.tokenizers.hf import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    vocab["ab"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    path = tmp_path / "tokenizer.json"
    tk.save(str(path))
    return path


@pytest.mark.parametrize("specials, eod, bos, pad", [
    (["<pad>", "</s>", "<s>"], 258, 259, 257),
    (["<|endoftext|>"], 257, None, None),
    ([], None, None, None),
])
def test_a_bpe_tokenizer_json_is_read_without_building_tokenizers(tmp_path, monkeypatch, specials, eod, bos, pad):
    """The vocabulary size, specials and added tokens read from the JSON equal what ``tokenizers``
    says; where gigatoken is the engine (self-check verdict cached) the ``tokenizers`` object is
    never built, where the reference is it is built on load. (The verdict's check runs without its
    Unicode probes, ~90k texts encoded one by one on ``tokenizers`` and no part of the subject: their
    outcome is no escapes; a probe text gigatoken then gets wrong fails the forced load.)"""
    import tokenizers

    from tokenloom.tokenizers import gigatoken_engine

    path = _small_bpe(tmp_path, specials)
    want = _hf_view(path)
    built = []
    from_file = tokenizers.Tokenizer.from_file
    monkeypatch.setattr(tokenizers.Tokenizer, "from_file", lambda p: built.append(p) or from_file(p))
    with monkeypatch.context() as m:
        m.setattr(gigatoken_engine, "unstable_chars", lambda reference, engine: "")
        load_tokenizer(path, backend="gigatoken")  # its first load runs the self-check against tokenizers
    for backend, builds in (("gigatoken", 0), ("reference", 1)):
        built.clear()
        tok = load_tokenizer(path, backend=backend)
        assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (want["vocab_size"], eod, bos, pad)
        assert tok.added_tokens() == want["added"]
        assert len(built) == builds, backend
        assert tok.decode(tok.encode("ab a</s>")) == "ab a" + ("" if "</s>" in specials else "</s>")


@needs_shared
def test_neox_tokenizer_json_read_from_its_json_equals_tokenizers(shared_verdicts):
    tok = load_tokenizer(TOK / "gpt-neox-20b" / "tokenizer.json", backend="reference")
    want = _hf_view(TOK / "gpt-neox-20b" / "tokenizer.json")
    assert (tok.vocab_size, tok.added_tokens()) == (want["vocab_size"], want["added"])
    assert tok.fingerprint()["digest"] == load_tokenizer(TOK / "gpt-neox-20b", backend="gigatoken").fingerprint()["digest"]


def test_a_bpe_tokenizer_json_tokenizers_refuses_is_refused_on_load(tmp_path):
    """Valid JSON with a BPE vocabulary but merges no loader can read: one line naming the file at
    load (``auto`` falls back to the reference, which builds ``tokenizers`` at once)."""
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}, "merges": 5},
                                "added_tokens": []}))
    with pytest.raises(TokenloomError, match="not a valid Hugging Face tokenizer.json") as err:
        load_tokenizer(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("kind", ["hf", "gpt2-bpe", "wordpiece", "sentencepiece", "tiktoken"])
def test_a_file_backed_spec_without_a_path_is_refused(kind):
    with pytest.raises(TokenloomError, match=f"tokenizer kind '{kind}' needs a path"):
        load_tokenizer(TokenizerSpec(kind))


@needs_shared
@pytest.mark.parametrize("megatron_type, folder", [
    ("HuggingFaceTokenizer", "gpt-neox-20b"), ("GPT2BPETokenizer", "gpt2"), ("SentencePieceTokenizer", "llama2/tokenizer.model"),
    ("Llama2Tokenizer", "llama2"), ("TikTokenizer", "gpt2/gpt2.tiktoken")])
def test_megatron_tokenizer_type_is_checked_against_the_files(megatron_type, folder):
    """Megatron's --tokenizer-type names what the files are; another type for the same files is one line."""
    path = TOK / folder
    check_megatron_type(path, megatron_type)
    other = "SentencePieceTokenizer" if megatron_type != "SentencePieceTokenizer" and "llama" not in folder \
        else "HuggingFaceTokenizer"
    with pytest.raises(TokenloomError, match=f"--tokenizer-type {other} means a .* tokenizer, but .* holds a"):
        check_megatron_type(path, other)


def test_megatron_tokenizer_type_errors():
    with pytest.raises(TokenloomError, match="--tokenizer-type Nope: unknown"):
        check_megatron_type(None, "Nope")
    with pytest.raises(TokenloomError, match="needs its files: --tokenizer-model PATH"):
        check_megatron_type(None, "HuggingFaceTokenizer")
    check_megatron_type(None, "NullTokenizer")
    with pytest.raises(TokenloomError, match="reads no files"):
        check_megatron_type("x", "NullTokenizer")


def test_a_folder_without_special_added_tokens_takes_its_tokenizer_config_specials(tmp_path):
    """A tokenizer.json whose ``<|endoftext|>`` is an ordinary vocabulary entry (GPT-2's, as
    ``cli.py export`` writes it) takes eod from tokenizer_config.json's ``eos_token`` (a string or an
    added-token object), as ``transformers`` does; an added-token candidate still comes first, a
    named token outside the vocabulary is no special, bos and pad keep their rule (added tokens only),
    and an unreadable file is one line naming it."""
    import tokenizers

    path = _small_bpe(tmp_path, [])
    data = json.loads(path.read_text())
    data["model"]["vocab"]["<|endoftext|>"] = eos = len(data["model"]["vocab"])
    path.write_text(json.dumps(data))
    assert tokenizers.Tokenizer.from_file(str(path)).token_to_id("<|endoftext|>") == eos
    config = tmp_path / "tokenizer_config.json"
    assert load_tokenizer(tmp_path, backend="reference").eod is None  # no tokenizer_config.json
    config.write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "ab", "bos_token": "<nowhere>"}))
    tok = load_tokenizer(tmp_path, backend="reference")
    assert (tok.eod, tok.bos, tok.pad) == (eos, None, None)
    config.write_text(json.dumps({"eos_token": "<nowhere>"}))
    assert load_tokenizer(tmp_path, backend="reference").eod is None
    config.write_text(json.dumps({"eos_token": {"content": "<|endoftext|>", "special": True}}))
    assert load_tokenizer(tmp_path, backend="reference").eod == eos
    (tmp_path / "added").mkdir()
    added = _small_bpe(tmp_path / "added", ["</s>"])
    (added.parent / "tokenizer_config.json").write_text(config.read_text())
    assert load_tokenizer(added.parent, backend="reference").eod == _hf_view(added)["vocab_size"] - 1  # </s>
    config.write_text("{not json")
    with pytest.raises(TokenloomError, match="tokenizer_config.json: not a readable tokenizer_config.json"):
        load_tokenizer(tmp_path, backend="reference")
