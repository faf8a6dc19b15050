import pytest
from transformers import AutoTokenizer

from flashreinforce.models import build_char_tokenizer

ARITHMETIC_ALPHABET = "0123456789+-*=;"

TEXT = "37+485=<think>7+5+0=12;3+8+1=12;0+4+1=5;</think>522<eos>"


def test_one_token_per_character_and_special_tokens_stay_whole():
    tok = build_char_tokenizer(ARITHMETIC_ALPHABET)
    # Specials come first, in order, then the alphabet.
    assert tok.convert_tokens_to_ids(["<pad>", "<eos>", "<unk>", "<think>", "</think>", "0", ";"]) == [
        0, 1, 2, 3, 4, 5, 5 + ARITHMETIC_ALPHABET.index(";")
    ]
    assert len(tok) == 5 + len(ARITHMETIC_ALPHABET)
    ids = tok.encode(TEXT)
    assert ids[:7] == [5 + ARITHMETIC_ALPHABET.index(c) for c in "37+485="]
    assert ids[7] == tok.convert_tokens_to_ids("<think>")
    assert len(ids) == len("37+485=") + 1 + len("7+5+0=12;3+8+1=12;0+4+1=5;") + 1 + len("522") + 1
    assert tok.decode(ids) == TEXT
    # pad/eos are dropped by skip_special_tokens, the think markers are kept for the verifier.
    assert tok.decode(ids, skip_special_tokens=True) == TEXT.removesuffix("<eos>")
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)


def test_unknown_characters_become_unk_instead_of_vanishing():
    tok = build_char_tokenizer("ab", special_tokens=("<pad>", "<eos>", "<unk>"))
    assert tok.convert_ids_to_tokens(tok.encode("a\nc")) == ["a", "<unk>", "<unk>"]


def test_saved_tokenizer_loads_with_plain_autotokenizer(tmp_path):
    tok = build_char_tokenizer(ARITHMETIC_ALPHABET + " \n")
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode(TEXT + " 1\n") == tok.encode(TEXT + " 1\n")
    assert loaded.decode(tok.encode(TEXT)) == TEXT
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.padding_side) == (0, 1, "right")
    batch = loaded(["1+2=", "33+4="], padding=True)
    assert batch["attention_mask"] == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_bad_vocabularies_are_rejected():
    with pytest.raises(ValueError, match="repeats"):
        build_char_tokenizer("0120")
    with pytest.raises(ValueError, match="also alphabet"):
        build_char_tokenizer("ab;", special_tokens=("<pad>", "<eos>", "<unk>", ";"))
    with pytest.raises(ValueError, match="eos_token"):
        build_char_tokenizer("ab", special_tokens=("<pad>", "<unk>"))
    with pytest.raises(ValueError, match="empty"):
        build_char_tokenizer("")
