"""Prompts everywhere (docs/architecture.md): `jd.generate`, `jd.beam_search`, `jd.speculative_generate`
and `jd.LLM` take a list of ints (one row), a list of lists, or a 1-D / 2-D integer numpy or jax
array, all through `jaxdecode.prompts.token_rows`; anything else is a ValueError naming the
field (`prompt_ids`, or `prompt` for the engine)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode.prompts import token_row, token_rows
from tests.host_fixtures import s4_tokenizer
from tests.scripted import Bigram, ScriptedModel

ROWS = [[5, 6, 7], [3, 2, 1]]
ROW = [5, 6, 7]

# the same two rows (or the one row) in every accepted form
TWO_ROWS = {
    "lists": ROWS,
    "tuples": tuple(tuple(r) for r in ROWS),
    "list of numpy rows": [np.asarray(r, np.int64) for r in ROWS],
    "list of jax rows": [jnp.asarray(r) for r in ROWS],
    "numpy 2-D int32": np.asarray(ROWS, np.int32),
    "numpy 2-D uint16": np.asarray(ROWS, np.uint16),
    "jax 2-D": jnp.asarray(ROWS),
}
ONE_ROW = {
    "list of ints": ROW,
    "list of numpy ints": [np.int32(i) for i in ROW],
    "list of jax scalars": list(jnp.asarray(ROW)),
    "numpy 1-D": np.asarray(ROW),
    "jax 1-D": jnp.asarray(ROW, jnp.int32),
    "jax 2-D, one row": jnp.asarray([ROW]),
}
# rejected forms -> a fragment of the message
BAD = {
    "floats in a list": ([5.0, 6.0], "must be integers"),
    "float rows": ([[5.0, 6.0]], "must be integers, got 5.0 in row 0"),
    "float array": (np.asarray(ROWS, np.float32), "must be integers, got an array of float32"),
    "jax float array": (jnp.asarray(ROW, jnp.float32), "must be integers"),
    "bools": ([True, False], "must be integers, got bool"),
    "bool array": (np.asarray([True, False]), "array of bool"),
    "3-D array": (np.zeros((1, 2, 3), np.int32), "1-D or 2-D array"),
    "0-D array": (np.asarray(5), "1-D or 2-D array"),
    "empty list": ([], "no prompts"),
    "empty row": ([[5, 6], []], "row 1 is empty"),
    "empty 1-D array": (np.zeros((0,), np.int32), "row 0 is empty"),
    "zero-width 2-D array": (np.zeros((2, 0), np.int32), "row 0 is empty"),
    "no rows 2-D array": (np.zeros((0, 3), np.int32), "no prompts"),
    "a string": ("hello", "got str"),
    "strings in a list": (["hello"], "got str"),
    "mixed row": ([5, [6]], "got [6] in row 0"),
    "None": (None, "got NoneType"),
}


@pytest.mark.parametrize("form", TWO_ROWS)
def test_token_rows_two_rows(form):
    rows = token_rows(TWO_ROWS[form])
    assert rows == ROWS and all(type(i) is int for r in rows for i in r)


@pytest.mark.parametrize("form", ONE_ROW)
def test_token_rows_one_row(form):
    assert token_rows(ONE_ROW[form]) == [ROW]
    assert token_row(ONE_ROW[form]) == ROW


def test_token_rows_ragged_and_engine_text_form():
    assert token_rows([[1], [2, 3, 4]]) == [[1], [2, 3, 4]]
    assert token_rows("abc", "prompt", text=True) == ["abc"]
    assert token_rows(["a", [1, 2], np.asarray([3])], "prompt", text=True) == ["a", [1, 2], [3]]
    assert token_rows([], "prompt", text=True) == []
    with pytest.raises(ValueError, match="^prompt: one prompt expected, got 2 rows"):
        token_row(np.asarray(ROWS), "prompt")


@pytest.mark.parametrize("form", BAD)
def test_token_rows_rejects_naming_the_field(form):
    value, fragment = BAD[form]
    with pytest.raises(ValueError, match="^prompt_ids: ") as e:
        token_rows(value)
    assert fragment in str(e.value)


# -- every entry point ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bigram():
    return Bigram.random(0)


SP = [jd.SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True),
      jd.SamplingParams(temperature=1.0, seed=2, max_tokens=6, ignore_eos=True)]


@pytest.mark.parametrize("form", ["lists", "numpy 2-D int32", "jax 2-D", "list of jax rows"])
def test_generate_accepts_every_form(bigram, form):
    ref = jd.generate(bigram, {}, ROWS, SP)
    out = jd.generate(bigram, {}, TWO_ROWS[form], SP)
    np.testing.assert_array_equal(out.token_ids, ref.token_ids)
    one = jd.generate(bigram, {}, jnp.asarray(ROW), SP[0])
    assert one.tokens(0) == ref.tokens(0)


def test_beam_search_and_speculative_accept_arrays(bigram):
    ref = jd.beam_search(bigram, {}, ROWS, num_beams=2, max_new_tokens=5)
    out = jd.beam_search(bigram, {}, jnp.asarray(ROWS), num_beams=2, max_new_tokens=5)
    np.testing.assert_array_equal(out.token_ids, ref.token_ids)
    assert out.beams == ref.beams
    ref = jd.speculative_generate(bigram, {}, "prompt_lookup", None, ROWS, SP, k=2)
    out = jd.speculative_generate(bigram, {}, "prompt_lookup", None, np.asarray(ROWS), SP, k=2)
    np.testing.assert_array_equal(out.token_ids, ref.token_ids)
    one = jd.speculative_generate(bigram, {}, "prompt_lookup", None, jnp.asarray(ROW), SP[0], k=2)
    assert one.tokens(0) == ref.tokens(0)


@pytest.mark.parametrize("form", ["float array", "3-D array", "empty row", "a string",
                                  "empty list"])
def test_device_entry_points_reject_naming_prompt_ids(bigram, form):
    value, fragment = BAD[form]
    calls = [lambda: jd.generate(bigram, {}, value, SP[0]),
             lambda: jd.beam_search(bigram, {}, value, num_beams=2, max_new_tokens=3),
             lambda: jd.speculative_generate(bigram, {}, "prompt_lookup", None, value, SP[0])]
    for call in calls:
        with pytest.raises(ValueError, match="^prompt_ids: ") as e:
            call()
        assert fragment in str(e.value)


def test_engine_accepts_arrays_and_rejects_naming_prompt():
    model = ScriptedModel.make([0, 65, 66, 67], vocab_size=258, eos_token_ids=(0,))
    greedy = jd.SamplingParams(temperature=0.0, max_tokens=2)
    with jd.LLM(model, {}, s4_tokenizer(), max_slots=2, max_len=64) as llm:
        for form in ("numpy 1-D", "jax 1-D", "jax 2-D, one row", "list of numpy ints"):
            h = llm.submit(ONE_ROW[form], greedy)
            assert h.prompt_ids == ROW and h.result().record.prompt_ids == ROW, form
        outs = llm.generate(jnp.asarray(ROWS), greedy)
        assert [c.record.prompt_ids for c in outs] == ROWS
        assert [c.prompt_index for c in outs] == [0, 1]
        mixed = llm.generate(["AB", np.asarray(ROW)], greedy)
        assert [c.prompt_index for c in mixed] == [0, 1] and mixed[1].record.prompt_ids == ROW
        assert llm.generate([], greedy) == []
        for form in ("float array", "3-D array", "empty row", "bools", "empty 1-D array"):
            value, fragment = BAD[form]
            with pytest.raises(ValueError, match="^prompt: ") as e:
                llm.submit(value, greedy)
            assert fragment in str(e.value), form
            with pytest.raises(ValueError, match="^prompt: "):
                llm.generate(value, greedy)
        with pytest.raises(ValueError, match="^prompt: one prompt expected, got 2 rows"):
            llm.submit(jnp.asarray(ROWS), greedy)
