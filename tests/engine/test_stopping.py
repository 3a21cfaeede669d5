from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from reader_spec.engine.stopping import StopCriteria
from tests.conftest import make_tiny_tokenizer

TOKENIZER = make_tiny_tokenizer()


def criteria(max_new=10, eos=(), stops=()):
    return StopCriteria(max_new, frozenset(eos), stops, TOKENIZER)


def test_no_limit_keeps_everything():
    assert criteria().clip([5, 6], [7, 8]) == ([7, 8], None)


def test_length_cuts_at_the_limit():
    assert criteria(max_new=4).clip([5, 6], [7, 8, 9]) == ([7, 8], "length")


def test_eos_is_kept_and_ends():
    assert criteria(eos=(1,)).clip([], [7, 1, 9]) == ([7, 1], "eos")


def test_stop_string_ends_at_the_token_that_completes_it():
    stop = criteria(stops=("w8 w9",))
    assert stop.clip([7], [8, 9, 10]) == ([8, 9], "stop")
    # The stop string may span earlier output and the newly accepted tokens.
    assert stop.clip([7, 8], [9, 10]) == ([9], "stop")
    assert stop.final_text([7, 8, 9]) == "w7 "


def test_final_text_without_stop():
    assert criteria().final_text([7, 1, 8]) == "w7 w8"


def make_byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """Letters ``a``..``f`` and the 256 ``<0xNN>`` byte tokens (anything else falls back to bytes),
    like SentencePiece models with byte fallback; ``<sep>`` is a special token."""
    vocab = {"<unk>": 0, "</s>": 1, "<sep>": 2}
    vocab.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})
    vocab.update({letter: 259 + i for i, letter in enumerate("abcdef")})
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="</s>", additional_special_tokens=["<sep>"]
    )


BYTES = make_byte_fallback_tokenizer()


def encode(text):
    return BYTES.encode(text, add_special_tokens=False)


def byte_criteria(*stops):
    return StopCriteria(100, frozenset(), stops, BYTES)


def test_byte_fallback_tokenizer_splits_characters_into_bytes():
    assert BYTES.convert_ids_to_tokens(encode("你好")) == [
        "<0xE4>", "<0xBD>", "<0xA0>", "<0xE5>", "<0xA5>", "<0xBD>",
    ]  # fmt: skip
    assert BYTES.decode(encode("abc 你好 def")) == "abc 你好 def"


def test_stop_string_of_multibyte_characters_is_found():
    # 你好 is two characters but six tokens: a window of as many tokens as characters (plus two) starts
    # inside 你 and decodes to replacement characters only.
    generated, new = encode("ab"), encode("abc 你好 def")
    kept, reason = byte_criteria("你好").clip(generated, new)
    assert reason == "stop"
    assert kept == encode("abc 你好")
    assert byte_criteria("你好").final_text([*generated, *kept]) == "ababc "


def test_stop_string_spanning_earlier_output_and_four_byte_characters():
    stop = byte_criteria("a😀😀")
    generated = encode("ca😀")
    kept, reason = stop.clip(generated, encode("😀b"))
    assert (kept, reason) == (encode("😀"), "stop")
    # One byte short of the second emoji: nothing is complete yet.
    assert stop.clip(generated, encode("😀")[:3]) == (encode("😀")[:3], None)


def test_stop_found_across_many_skipped_special_tokens():
    sep = BYTES.convert_tokens_to_ids("<sep>")
    tokens = [*encode("ab"), *[sep] * 20, *encode("cd")]
    kept, reason = byte_criteria("bc").clip(tokens[:1], tokens[1:])
    assert (kept, reason) == (tokens[1:-1], "stop")


def test_finish_reason_and_text_agree_around_special_tokens():
    # Special tokens are not in the returned text: a stop string spanning one is in the text and ends
    # the request ...
    stop = criteria(stops=("w7 w8",))
    kept, reason = stop.clip([], [7, 1, 8, 9])
    assert (kept, reason) == ([7, 1, 8], "stop")
    assert stop.final_text(kept) == ""
    # ... and one made of a special token's own text is in neither.
    stop = criteria(stops=("w7 w1",))
    assert stop.clip([], [7, 1, 8]) == ([7, 1, 8], None)
    assert stop.final_text([7, 1, 8]) == "w7 w8"


class CountingTokenizer:
    """Records how many tokens each decode is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sizes = tokenizer, []

    def decode(self, tokens, **kwargs):
        self.sizes.append(len(tokens))
        return self.tokenizer.decode(tokens, **kwargs)


def test_stop_check_decodes_a_short_tail_only():
    # Long runs of byte tokens, ending both inside a character and after one, and plain letters.
    counting = CountingTokenizer(BYTES)
    stop = StopCriteria(10_000, frozenset(), ("好你好",), counting)
    for text in ("abcdef" * 200, "你" * 300, "😀" * 300):
        generated, new = encode(text), encode("你" + text[:30])
        assert stop.clip(generated, new) == (new, None)
    assert max(counting.sizes) <= 40
