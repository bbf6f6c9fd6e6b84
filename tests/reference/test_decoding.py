"""A completion's text as its tokens come (restartkit.reference.serving.protocol.Decoding): a few tokens decoded
per token, and after every token the text of all of them, as decoding them all at once gives it."""
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from restartkit.reference.model.checkpoint import PRESETS, write_tokenizer
from restartkit.reference.serving.protocol import Decoding, TextSoFar


def byte_level(tmp_path) -> Tokenizer:
    """The reference checkpoints' tokenizer: byte b is token b, then BOS and EOS (special)."""
    write_tokenizer(tmp_path, PRESETS["tiny"].config)
    return Tokenizer.from_file(str(tmp_path / "tokenizer.json"))


def sentencepiece_like() -> Tokenizer:
    """A Metaspace decoder, as SentencePiece's: '▁' is a space, and a text's first one is dropped."""
    vocab = {"<unk>": 0, "▁a": 1, "▁b": 2, "c": 3, "▁": 4, "d": 5}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


def utf8_heavy(rng: random.Random, n: int) -> list[int]:
    """Byte tokens of text with 1-4 byte characters, cut anywhere, some invalid bytes and special tokens."""
    out: list[int] = []
    while len(out) < n:
        r = rng.random()
        if r < 0.05:
            out.append(rng.choice([256, 257]))  # BOS, EOS: skipped in the text
        elif r < 0.1:
            out.append(rng.choice([0xff, 0x80, 0xc3]))  # a byte no character starts or ends with
        else:
            out += list(rng.choice("aé€😀 \n").encode())
    return out[:n]


@pytest.mark.parametrize("seed", range(5))
def test_the_text_after_each_token_is_the_whole_decode(tmp_path, seed):
    tok = byte_level(tmp_path)
    ids = utf8_heavy(random.Random(seed), 400)
    d = Decoding(tok)
    for n, t in enumerate(ids, 1):
        assert d.add(t) == tok.decode(ids[:n], skip_special_tokens=True), n
    assert d.incremental
    assert d.context > 300  # it decodes a window since the last whole character, not everything


def test_a_decoder_that_drops_a_texts_first_space_still_decodes_as_the_whole():
    tok = sentencepiece_like()
    rng = random.Random(1)
    ids = [rng.randrange(1, 6) for _ in range(300)]
    d = Decoding(tok)
    for n, t in enumerate(ids, 1):
        assert d.add(t) == tok.decode(ids[:n]), n


def test_stop_strings_still_end_the_text_where_they_start(tmp_path):
    tok = byte_level(tmp_path)
    sent = []
    so_far = TextSoFar(tok, ["€x", "zz"], send=sent.append)
    ids = list("ab€€y€".encode()) + list("€xq".encode())
    stopped = [so_far(t) for t in ids]
    assert stopped.index(True) == len("ab€€y€".encode()) + len("€x".encode()) - 1
    assert so_far.text == "ab€€y€" and "".join(sent) == "ab€€y€"
    kept = TextSoFar(tok, ["€x", "zz"], include_stop=True)  # vLLM's include_stop_str_in_output
    assert [kept(t) for t in ids].index(True) == stopped.index(True) and kept.text == "ab€€y€€x"


def test_a_stream_gets_a_piece_for_every_token_empty_while_its_text_is_held(tmp_path):
    """As vLLM streams: the client sees each token come (and times its first token by the first chunk), even while
    a character's bytes or a possible stop string hold its text back."""
    tok = byte_level(tmp_path)
    sent, quiet = [], []
    each, held = TextSoFar(tok, ["zz"], send=sent.append, each_token=True), TextSoFar(tok, ["zz"], send=quiet.append)
    ids = list("a€z".encode()) + list("b".encode())
    for t in ids:
        each(t)
        held(t)
    assert sent == ["a", "", "", "€", "", "zb"] and quiet == ["a", "€", "zb"]
