"""Tokenizer and IncrementalDetokenizer on the default model's converted folder.

The folder comes from default_model_dir() (the user's cache, converted on first use).
"""

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from jinja2 import TemplateError

from pd_serve.model.gguf_default import default_model_dir
from pd_serve.model.tokenizer import IncrementalDetokenizer, Tokenizer

MULTIBYTE = "héllo 世界 🙂 done"
CONVERSATIONS = {
    "with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? héllo 🙂"},
    ],
    "without_system": [{"role": "user", "content": "Hi there"}],
}


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="session")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="session")
def hf_tok(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def _copy_tokenizer(model_dir: Path, dest: Path, **config_overrides) -> Path:
    shutil.copy(model_dir / "tokenizer.json", dest / "tokenizer.json")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.update(config_overrides)
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def test_special_ids(tok):
    assert tok.eos_token_ids == frozenset({2})
    assert tok.bos_token_id == 1
    assert tok.vocab_size == 49152


@pytest.mark.parametrize("text", ["Hello, world!", "12345", MULTIBYTE,
                                  "for i in range(10):\n\tprint(i)",
                                  "<|im_start|>user\nhi<|im_end|>"])
def test_encode_decode_match_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text)
    assert tok.encode(text, add_special_tokens=False) == ids  # this model adds no BOS
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert ("You are a helpful AI assistant" in ours) == (name == "without_system")


def test_template_helpers_match_transformers(tok, hf_tok, tmp_path, model_dir):
    source = ("{% for m in messages %}{{ m | tojson }}{% if m.role == 'bad' %}"
              "{{ raise_exception('bad role') }}{% endif %}{% if loop.last %}{% break %}"
              "{% endif %}\n{% endfor %}{{ bos_token }}|{{ eos_token }}")
    (_copy_tokenizer(model_dir, tmp_path) / "chat_template.jinja").write_text(source)
    custom = Tokenizer.from_dir(tmp_path)  # chat_template.jinja wins over tokenizer_config
    messages = [{"role": "user", "content": "<a & 'é'>"}, {"role": "assistant", "content": "x"}]
    assert custom.apply_chat_template(messages) == hf_tok.apply_chat_template(
        messages, chat_template=source, tokenize=False, add_generation_prompt=True)
    assert '"<a & \'é\'>"' in custom.apply_chat_template(messages)
    with pytest.raises(TemplateError, match="bad role"):
        custom.apply_chat_template([{"role": "bad", "content": ""}])


def test_no_chat_template_is_a_clear_error(model_dir, tmp_path):
    _copy_tokenizer(model_dir, tmp_path, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_dict_tokens_and_generation_config_eos(model_dir, tmp_path):
    _copy_tokenizer(model_dir, tmp_path, bos_token={"content": "<|endoftext|>"},
                    eos_token={"content": "<|im_end|>", "special": True})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.bos_token_id == 0
    assert loaded.eos_token_ids == frozenset({0, 2, 5})
    assert loaded.apply_chat_template([]).endswith("<|im_start|>assistant\n")


def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_dir(tmp_path)


def _stream(tok, prompt_ids, ids, **kwargs):
    detok = IncrementalDetokenizer(tok, prompt_ids, **kwargs)
    deltas = [detok.step([i]) for i in ids]
    return detok, deltas


def test_incremental_detokenizer_never_splits_characters(tok):
    prompt_ids = tok.encode("Say something: ")
    ids = tok.encode(MULTIBYTE)
    detok, deltas = _stream(tok, prompt_ids, ids)
    assert "".join(deltas) == tok.decode(ids) == MULTIBYTE
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some tokens carry only part of a character: the test exercises that


def test_incremental_detokenizer_multi_token_steps_and_specials(tok):
    ids = tok.encode(MULTIBYTE + "<|im_end|>")
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        deltas = [detok.step(ids[i:i + 3]) for i in range(0, len(ids), 3)]
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas).endswith("<|im_end|>") == (not skip)


def test_incremental_detokenizer_window_stays_small(tok):
    ids = tok.encode("word " * 300)
    detok, deltas = _stream(tok, [], ids)
    assert "".join(deltas) == tok.decode(ids)
    assert len(detok._ids) <= 4  # decoding work per step does not grow with the output


def _ends_inside_a_character(tok) -> list[int]:
    """Ids of MULTIBYTE up to a token that carries only part of a character."""
    ids = tok.encode(MULTIBYTE)
    k = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    return ids[:k]


def test_an_output_that_ends_inside_a_character_is_flushed_as_decode_gives_it(tok):
    ids = _ends_inside_a_character(tok)
    detok, deltas = _stream(tok, tok.encode("Say something: "), ids)
    assert deltas[-1] == ""  # held back while more bytes could come
    tail = detok.flush()
    assert tail.endswith("\ufffd")
    assert "".join(deltas) + tail == tok.decode(ids)
    assert detok.flush() == ""


def test_output_text_hands_out_the_tail_when_the_output_ends(tok):
    from pd_serve.model.output_text import OutputText

    ids = _ends_inside_a_character(tok)
    for stop in ([], ["\x00never"]):
        out = OutputText(tok, [], stop)
        assert out.add(ids) == len(ids)
        running = out.take_delta(finished=False)
        assert running + out.take_delta(finished=True) == out.text == tok.decode(ids)
    stopped = OutputText(tok, [], [tok.decode(ids[:1])])  # a stop string cuts first: no tail
    stopped.add(ids)
    assert stopped.stopped and stopped.take_delta(finished=True) == ""


def test_output_text_cuts_at_the_first_stop_string_and_holds_only_the_hold_back(tok):
    """Token by token with a delta taken after each: the stream is the text cut before the
    first stop string, never shows a stop string's start, and keeps only the hold-back unsent
    (the text so far is not copied per token)."""
    from pd_serve.model.output_text import OutputText

    text = ("The quick brown fox jumps over the lazy dog. " * 40) + MULTIBYTE + " END marker"
    ids = tok.encode(text)
    # (the first stop string to complete is also the one that starts first)
    cases = [[], ["\x00never"], ["END"], ["lazy dog. The", "jumps"], ["世界", "zzz"],
             [MULTIBYTE + " END"]]
    for stop in cases:
        out = OutputText(tok, [], stop)
        holdback = max((len(s) for s in stop), default=1) - 1
        stream, taken = [], 0
        for i in range(0, len(ids), 3):  # three ids a step, as a worker batches them
            taken += out.add(ids[i:i + 3])
            stream.append(out.take_delta(finished=out.stopped))
            assert len(out._unsent) <= holdback + 16, stop
            if out.stopped:
                break
        else:
            stream.append(out.take_delta(finished=True))
        hits = [j for j in (text.find(s) for s in stop) if j >= 0]
        want = text[:min(hits)] if hits else text
        assert "".join(stream) == out.text == out.shown == want, stop
        assert out.stopped == bool(hits)
        assert len(out.token_offsets) == taken
        assert out.token_offsets == sorted(out.token_offsets)
        assert out.token_offsets[-1] < len(want) + max(map(len, stop), default=1)


@pytest.mark.parametrize("text", ["hello world", MULTIBYTE, "a\tb\nc  d<|im_end|>x", " \x00\x7f"])
def test_token_bytes_of_a_byte_level_vocabulary_rebuild_the_text(tok, text):
    """Byte-level BPE: the tokens' bytes join to the text's UTF-8, also where one character
    spans tokens whose own text decode shows as U+FFFD."""
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    partial = [i for i in ids if tok.decode([i]) == "\ufffd"]
    if text == MULTIBYTE:
        assert partial and all(tok.token_bytes(i) != "\ufffd".encode() for i in partial)


def test_token_bytes_of_a_byte_fallback_vocabulary(tmp_path):
    """SentencePiece style (Llama 2, Mistral): <0xNN> tokens are one byte each, and ▁ a space."""
    from tokenizers import Tokenizer as Backend, decoders, models, normalizers

    vocab = {"<unk>": 0, "▁": 1, "h": 2, "i": 3, "▁hi": 4,
             **{f"<0x{b:02X}>": 5 + b for b in range(256)}}
    backend = Backend(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.save(str(tmp_path / "tokenizer.json"))
    fallback = Tokenizer.from_dir(tmp_path)
    ids = fallback.encode("hi 世界", add_special_tokens=False)
    assert [fallback.token_bytes(i) for i in ids[-6:]] == [bytes([b]) for b in "世界".encode()]
    assert b"".join(fallback.token_bytes(i) for i in ids) == " hi 世界".encode()


def test_incremental_detokenizer_window_stays_small_on_bytes_that_form_no_character(tok):
    """A model made to emit lone UTF-8 continuation bytes (logit_bias on the 0x80 byte token)
    gives text that ends in U+FFFD at every step: the window grew a token a step and each step
    decoded all of it (8k such tokens: 8 s of the gateway's event loop per choice). The window
    now stays small, and the text is still exactly the whole output's decode, valid
    characters split over tokens among the garbage included."""
    (byte,) = [t for t in range(tok.vocab_size) if tok.token_bytes(t) == b"\x80"]
    split = tok.encode(MULTIBYTE, add_special_tokens=False)
    for ids in ([byte] * 2000, [byte] * 30 + split + [byte] * 7 + split + [byte] * 13,
                ([byte] * 9 + split) * 20):
        detok, deltas = _stream(tok, tok.encode("hi"), ids)
        assert "".join(deltas) + detok.flush() == tok.decode(ids)
        assert len(detok._ids) <= 16
    decoded = []  # ids decoded over the 2000 steps: linear in the output, not quadratic
    detok = IncrementalDetokenizer(tok, [])
    detok._decode = lambda ids: decoded.append(len(ids)) or tok.decode(ids)
    for _ in range(2000):
        detok.step([byte])
    assert sum(decoded) < 100 * 2000


def test_output_text_keeps_the_stop_string_or_waits_for_min_tokens(tok):
    """include_stop: the text ends after the stop string; min_tokens: a stop string in the
    first min_tokens tokens ends nothing (vLLM's rules)."""
    from pd_serve.model.output_text import OutputText

    text = "one two three four five six seven"
    ids = tok.encode(text)
    kept = OutputText(tok, [], [" three", " f"], include_stop=True)
    kept.add(ids)
    assert kept.stopped and kept.take_delta(finished=True) == "one two three"
    cut = OutputText(tok, [], [" three"])
    cut.add(ids)
    assert cut.take_delta(finished=True) == "one two"
    upto = next(i for i in range(1, len(ids)) if " three" in tok.decode(ids[:i]))  # tokens to it
    late = OutputText(tok, [], [" three", " six"], min_tokens=upto)
    late.add(ids)
    assert late.stopped and late.text == "one two three four five"
    early = OutputText(tok, [], [" three"], min_tokens=upto - 1)
    early.add(ids)
    assert early.text == "one two"
    # a short stop string inside the first min_tokens tokens ends nothing later, whatever the
    # longest stop string (each is looked for where it could end in the new text)
    mixed = OutputText(tok, [], ["one", " a much longer stop string"], min_tokens=1)
    mixed.add(ids)
    assert not mixed.stopped and mixed.take_delta(finished=True) == text
