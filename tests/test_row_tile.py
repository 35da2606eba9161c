"""`LLM(row_tile=...)` / `serve --row-tile` (contract X1, §11; docs/batch_invariance.md "Row
tiles"): the rows per weight-product tile are a static engine setting. At any tile a seeded
request gets the same tokens alone and crowded; records pin the tile and replay names a
different one; a tile this CPU's products cannot keep invariant, or a model without tiles, is a
clear error naming the field. (The bitwise logit checks at 16 rows are parametrized in
tests/test_batch_invariance.py.)"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxdecode as jd
from jaxdecode import invariance
import models
from jaxdecode.engine import config as engine_config

FIB = "def fibonacci(n):"
SP = jd.SamplingParams(temperature=0.8, seed=50448, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def wide(demo):
    model, params, tok = demo
    with jd.LLM(model, params, tok, max_slots=4, max_len=256, row_tile=16,
                model_source="demo") as llm:
        yield llm


def test_row_tile_X1_alone_crowded_and_generate_agree_at_16_rows(demo, wide):
    model, params, tok = demo
    assert wide.model.row_tile == 16 and model.row_tile == models.layers.ROW_TILE
    want = jd.generate(model.with_row_tile(16), params, [tok.encode(FIB).ids], SP).tokens(0)
    alone = wide.generate([FIB], SP)[0]
    crowd = wide.generate(["import os", FIB, "class A:", "x = 1"], SP)[1]
    assert list(alone.token_ids) == want == list(crowd.token_ids)


def _product_rows(jaxpr) -> set:
    """Row counts of the 2-D weight products (dot_general of two matrices) in a jaxpr."""
    rows = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and all(v.aval.ndim == 2 for v in eqn.invars):
            rows.add(eqn.invars[0].aval.shape[0])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    rows |= _product_rows(inner)
    return rows


def test_row_tile_sets_the_rows_of_every_weight_product(demo):
    """A decode step of 3 rows runs every weight product (layers and head) on row_tile rows."""
    model, params, _ = demo
    tokens = jnp.ones((3, 1), jnp.int32)
    for tile in (4, 16):
        tiled = model.with_row_tile(tile)
        jaxpr = jax.make_jaxpr(lambda p, c: tiled.forward(p, tokens, tokens, c, lengths=jnp.ones(
            3, jnp.int32))[0])(params, tiled.init_cache(3, 128, jnp.float32))
        assert _product_rows(jaxpr.jaxpr) == {tile}


def test_row_tile_X11_record_pins_the_tile_and_replay_names_another(demo, wide, tmp_path):
    model, params, tok = demo
    record = wide.generate([FIB], SP)[0].record
    assert record.data["batch_invariance"]["row_tile"] == 16
    assert jd.replay(record, wide).identical
    with jd.LLM(model, params, tok, max_slots=4, max_len=256) as default:
        report = jd.replay(record, default)
    assert any(d.startswith("row_tile: recorded 16, now 4") for d in
               report.environment_differences), report.environment_differences
    # `jaxdecode replay FILE` builds its engine at the recorded tile
    from jaxdecode.cli.replay import cmd_replay
    path = tmp_path / "record.json"
    record.save(str(path))
    assert cmd_replay(argparse.Namespace(file=str(path), model="demo",
                                         allow_params_mismatch=False)) == 0


def test_row_tile_the_draft_of_a_speculative_engine_gets_the_tile(demo):
    model, params, tok = demo
    draft, draft_params, _ = models.demo("draft")
    with jd.LLM(model, params, tok, max_slots=2, max_len=256, row_tile=16,
                speculative={"draft": (draft, draft_params), "k": 4}) as llm:
        assert llm._admission.speculative.draft.row_tile == 16


def test_row_tile_bad_values_and_models_name_the_field(demo):
    model, params, tok = demo
    for bad in (0, 257, 2.0, True):
        with pytest.raises(ValueError, match="row_tile"):
            jd.LLM(model, params, tok, max_slots=2, max_len=64, row_tile=bad)

    @dataclasses.dataclass(frozen=True)
    class Untiled:
        config: object
        batch_invariant = False

    with pytest.raises(ValueError, match="row_tile: Untiled has no row tiles"):
        engine_config.row_tiled(Untiled(model.config), 8)
    assert engine_config.row_tiled(Untiled(model.config), None).config is model.config


def test_row_tile_the_products_must_be_place_invariant_at_the_tile(monkeypatch):
    """X1: a tile at which this CPU's products give a row different bits at different places is
    refused (the default tile decided the product library; another one is probed)."""
    invariance.check_row_tile.cache_clear()
    monkeypatch.setattr(invariance, "place_invariant", lambda options, rows=4: rows != 12)
    try:
        invariance.check_row_tile(8)
        with pytest.raises(ValueError, match="row_tile: .* 12-row tile"):
            invariance.check_row_tile(12)
    finally:
        invariance.check_row_tile.cache_clear()


def test_row_tile_serve_flag_is_checked_and_named():
    from serving.loading import flag_error
    from serving.server import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).row_tile is None and p.parse_args(["--row-tile", "16"]).row_tile == 16
    model, _, _ = models.demo()
    with pytest.raises(ValueError) as e:
        model.with_row_tile(0)
    assert str(flag_error(e.value)).startswith("--row-tile: row_tile:")
