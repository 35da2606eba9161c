"""`jaxdecode bench`'s decode table: the HF column says what it ran on (framework, device, dtype),
so a report from an accelerator names the GPU run beside jaxdecode's."""

import argparse

import pytest

pytest.importorskip("torch")


def test_hf_column_names_its_device_and_dtype(tmp_path):
    from jaxdecode.cli.bench import BenchConfig, run
    from jaxdecode.cli.bench.configs import bench_model, hf_comparable, hf_device
    from jaxdecode.cli.bench.report import format_table

    assert hf_comparable() and hf_device() == "cpu"  # the test machine's jax runs on the CPU
    model, params, hf = bench_model("llama-tiny", True, str(tmp_path))
    report = run(model, params, BenchConfig(batches=(1,), prompt_len=4, new_tokens=8, repeats=1),
                 hf_model=hf)
    assert report["dtype"] == "float32"
    assert report["hf"]["device"] == "cpu" and report["hf"]["dtype"] == "float32"
    assert report["rows"][0]["hf"]["tokens_per_s"] > 0
    table = format_table(report)
    assert f"HF torch {report['hf']['torch']} on cpu, float32" in table


def test_invariance_tax_times_the_fast_path_beside_the_invariant_model(tmp_path):
    """`bench --invariance-tax`: each batch row also times the model without batch invariance
    (its own column, its HF ratio and the tax); the report names the construction timed."""
    from jaxdecode import invariance
    from jaxdecode.cli.bench import BenchConfig, run
    from jaxdecode.cli.bench.configs import bench_model
    from jaxdecode.cli.bench.report import format_table

    model, params, hf = bench_model("llama-tiny", True, str(tmp_path))
    fast = invariance.configure(model, batch_invariant=False)
    report = run(model, params, BenchConfig(batches=(1, 2), prompt_len=4, new_tokens=8,
                                            repeats=1), hf_model=hf, fast_model=fast)
    assert report["batch_invariance"] == "row_tiles"
    for row in report["rows"]:
        assert row["fast"]["tokens_per_s"] > 0 and row["fast_ratio"] > 0
        assert row["tax"] == pytest.approx(
            1 - row["jaxdecode"]["tokens_per_s"] / row["fast"]["tokens_per_s"])
    assert "invariance tax" in format_table(report)
    assert "invariance tax" not in format_table(run(model, params, BenchConfig(
        batches=(1,), prompt_len=4, new_tokens=8, repeats=1)))


def test_invariance_flags_name_their_conflicts():
    from jaxdecode import cli

    with pytest.raises(SystemExit, match="--invariance-tax: not with --no-batch-invariant"):
        cli.main(["bench", "--invariance-tax", "--no-batch-invariant"])
    with pytest.raises(SystemExit, match="--no-batch-invariant: not used by the HTTP load test"):
        cli.main(["bench", "--serve", "--no-batch-invariant"])


@pytest.mark.parametrize("name,family", [("gemma-512", "gemma2"), ("moe-512", "mixtral")])
def test_named_config_is_what_its_hf_config_loads_as(tmp_path, name, family):
    """`bench --model gemma-512` / `moe-512`: the jaxdecode model built from the named
    configuration is the one models.load reads from the HF config of the same keywords (the
    --compare-hf path), so both columns time the same architecture."""
    import dataclasses
    import json

    import transformers

    from jaxdecode.cli.bench.configs import BENCH_CONFIGS, named_model
    from models import hf

    kw = dict(BENCH_CONFIGS[name])
    config = transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    read = hf._gemma_config if family == "gemma2" else hf._moe_config
    loaded = read(config.to_dict(), tmp_path / "config.json", family, ())
    ours = named_model(name).config
    assert ours == dataclasses.replace(loaded, eos_token_ids=ours.eos_token_ids)
    if family == "gemma2":
        assert ours.sliding_window == 512 and ours.attn_logit_softcapping == 50.0
    else:  # a token's active expert weights equal llama-512's MLP
        llama = named_model("llama-512").config
        assert ours.num_experts == 8 and ours.num_experts_per_tok == 2
        assert ours.num_experts_per_tok * ours.moe_intermediate_size == llama.intermediate_size


def test_lora_section_times_two_adapters_beside_none(tmp_path):
    """`bench --lora`: per batch, the step with no adapter and with two (ranks 8 and 16) in
    the batch on every projection and on q/v only, side by side, compiling nothing after its
    warm-up round."""
    from jaxdecode.cli.bench import lora
    from jaxdecode.cli.bench.configs import bench_model

    model, params, _ = bench_model("llama-tiny", False, str(tmp_path))
    report = lora.time_lora(model, params, batches=(1, 2), steps=2, repeats=1)
    assert report["ranks"] == [8, 16] and [r["batch"] for r in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert row["none_step_ms"] > 0 and row["lora_step_ms"] > 0 and row["lora_qv_step_ms"] > 0
        assert row["compiles_after_warmup"] == 0
    assert "2 adapters, q_proj + v_proj" in lora.format_lora_table(report)


def test_paged_section_with_int8_kv_times_int8_pages_beside_float_ones(tmp_path):
    """`bench --paged --kv-cache-dtype int8` (contract §12): per batch the step over int8 pages
    beside the float pages and the contiguous cache, with the positions each pool holds per
    GiB (a float32 model's int8 pool: about 4x, less its scales)."""
    from jaxdecode.cli.bench import paged
    from jaxdecode.cli.bench.configs import bench_model

    model, params, _ = bench_model("llama-tiny", False, str(tmp_path))
    report = paged.time_paged(model, params, batches=(1, 2), steps=2, repeats=1,
                              kv_cache_dtype="int8")
    for row in report["rows"]:
        assert row["paged_int8_step_ms"] > 0 and row["paged_step_ms"] > 0
        assert row["compiles_after_warmup"] == 0
    per_gib = report["tokens_per_gib"]
    head_dim = model.config.head_dim
    assert per_gib["int8"] / per_gib["auto"] == pytest.approx(4 * head_dim / (head_dim + 2),
                                                              rel=1e-3)
    assert "int8 pages" in paged.format_paged_table(report)


def test_kv_cache_dtype_flag_needs_a_section_that_reads_the_pool():
    from jaxdecode.cli.bench.command import _settle

    args = argparse.Namespace(kv_cache_dtype="int8", paged=False, engine=False, report=None,
                              invariance_tax=False, batch_invariant=True)
    with pytest.raises(SystemExit, match="--kv-cache-dtype"):
        _settle(args)
