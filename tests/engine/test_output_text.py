"""Incremental detokenization with stop strings, on a fake vocabulary of raw byte pieces."""

from __future__ import annotations

import pytest

from specserve.engine.output_text import OutputText

EURO = "€".encode()  # b"\xe2\x82\xac"
E_ACUTE = "é".encode()  # b"\xc3\xa9"


class Vocab:
    """Token ids for byte pieces, assigned on first use."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def ids(self, *pieces: bytes | str) -> list[int]:
        out = []
        for piece in pieces:
            self.pieces.append(piece.encode() if isinstance(piece, str) else piece)
            out.append(len(self.pieces) - 1)
        return out

    def token_bytes(self, token_id: int) -> bytes:
        return self.pieces[token_id]


def feed(*pieces: bytes | str, stop: tuple[str, ...] = ()) -> tuple[OutputText, list[bool]]:
    """Append the pieces until a stop string completes; returns the text and each append's result."""
    vocab = Vocab()
    out = OutputText(vocab.token_bytes, stop)
    results = []
    for token in vocab.ids(*pieces):
        results.append(out.append(token))
        if results[-1]:
            break
    return out, results


def test_plain_text_accumulates() -> None:
    out, results = feed("Hel", "lo", " world")
    assert results == [False, False, False]
    assert out.text == "Hello world"
    assert out.stopped_by is None
    assert out.take_delta(final=True) == "Hello world"


def test_stop_string_inside_one_token() -> None:
    out, results = feed("Hello", " abcSTOPdef", "more", stop=("STOP",))
    assert results == [False, True]
    assert out.text == "Hello abc"
    assert out.stopped_by == "STOP"


def test_stop_string_across_tokens() -> None:
    out, results = feed("Hello S", "T", "OP and more", stop=("STOP",))
    assert results == [False, False, True]
    assert out.text == "Hello "
    assert out.stopped_by == "STOP"


def test_stop_string_at_the_very_start() -> None:
    out, results = feed("STOP", "x", stop=("STOP",))
    assert results == [True]
    assert out.text == ""
    assert out.take_delta(final=True) == ""


def test_stop_string_split_at_the_start_across_tokens() -> None:
    out, results = feed("\n", "\n", "x", stop=("\n\n",))
    assert results == [False, True]
    assert out.text == ""


def test_earliest_of_several_stop_strings_wins() -> None:
    out, results = feed("a b END c STOP", stop=("STOP", "END"))
    assert results == [True]
    assert out.text == "a b "
    assert out.stopped_by == "END"


def test_stop_string_completing_later_in_a_long_token() -> None:
    # The window searched after each token must reach back far enough for a long stop string.
    out, results = feed("xx</fun", "ction>yy", stop=("</function>",))
    assert results == [False, True]
    assert out.text == "xx"


def test_take_delta_holds_back_a_possible_stop_prefix() -> None:
    vocab = Vocab()
    out = OutputText(vocab.token_bytes, ("STOP",))
    hello, st, oops, op = vocab.ids("Hello S", "T", "Ox", "OP")

    assert not out.append(hello)
    assert out.take_delta(final=False) == "Hello "  # "S" may start "STOP"
    assert not out.append(st)
    assert out.take_delta(final=False) == ""  # "ST" still may
    assert not out.append(oops)  # "STOx": not a stop string after all
    assert out.take_delta(final=False) == "STOx"
    assert not out.append(hello)
    assert out.take_delta(final=False) == "Hello "
    assert out.append(st) is False
    assert out.append(op) is True
    assert out.take_delta(final=True) == ""  # the held-back "ST" was part of the stop string
    assert out.text == "Hello STOxHello "


def test_take_delta_final_releases_the_held_back_tail() -> None:
    out, _ = feed("Hello ST", stop=("STOP",))
    assert out.take_delta(final=False) == "Hello "
    assert out.take_delta(final=True) == "ST"
    assert out.take_delta(final=True) == ""


def test_deltas_add_up_to_the_text() -> None:
    vocab = Vocab()
    stops = ("<|end|>", "\n\n")
    out = OutputText(vocab.token_bytes, stops)
    pieces = ["def", " f", "(", "x", "):", "\n", "   ", " return", " x", "<", "|", "en", "d|", ">", "tail"]
    deltas = []
    for token in vocab.ids(*pieces):
        stopped = out.append(token)
        deltas.append(out.take_delta(final=stopped))
        assert "<" not in "".join(deltas)  # the start of the stop string is never streamed
        if stopped:
            break
    assert "".join(deltas) == out.text == "def f(x):\n    return x"
    assert out.stopped_by == "<|end|>"


def test_multibyte_character_split_across_tokens_is_emitted_when_complete() -> None:
    vocab = Vocab()
    out = OutputText(vocab.token_bytes, ())
    first, second, third = vocab.ids(b"caf" + E_ACUTE[:1], E_ACUTE[1:] + EURO[:1], EURO[1:])
    assert not out.append(first)
    assert out.text == "caf"
    assert out.take_delta(final=False) == "caf"
    assert not out.append(second)
    assert out.text == "café"
    assert out.take_delta(final=False) == "é"
    assert not out.append(third)
    assert out.text == "café€"
    assert "\ufffd" not in out.text


@pytest.mark.parametrize("pieces", [[EURO[:1], EURO[1:2], EURO[2:]], [EURO[:2], EURO[2:]]])
def test_character_split_over_several_tokens(pieces: list[bytes]) -> None:
    out, results = feed(*pieces)
    assert results == [False] * len(pieces)
    assert out.text == "€"


def test_stop_string_after_a_split_character() -> None:
    out, results = feed(E_ACUTE[:1], E_ACUTE[1:] + b"!", b"?", stop=("é!",))
    assert results == [False, True]
    assert out.text == ""


def test_finish_turns_a_dangling_partial_character_into_replacement() -> None:
    out, _ = feed(b"ab" + EURO[:2])
    assert out.text == "ab"
    out.finish()
    assert out.text == "ab\ufffd"
    assert out.take_delta(final=True) == "ab\ufffd"


def test_finish_after_complete_text_changes_nothing() -> None:
    out, _ = feed("abc", E_ACUTE)
    out.finish()
    assert out.text == "abcé"


def test_finish_after_a_stop_string_keeps_the_cut_text() -> None:
    out, _ = feed(b"abSTOP", stop=("STOP",))
    out.finish()
    assert out.text == "ab"


def test_invalid_bytes_become_replacement_characters() -> None:
    out, _ = feed(b"a\xffb")
    assert out.text == "a\ufffdb"
