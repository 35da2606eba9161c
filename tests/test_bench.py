"""`jaxdecode bench`'s decode table: the HF column says what it ran on (framework, device, dtype),
so a report from an accelerator names the GPU run beside jaxdecode's."""

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
