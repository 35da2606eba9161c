"""The `jaxdecode` command on the embedded demo model, in fresh processes."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxdecode.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_cli_generate_json_and_stop_string():
    out = cli("generate", "--prompt", "def add(a, b):", "--max-tokens", "30", "--seed", "1",
              "--stop", "return", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "return" not in result["text"]
    assert result["usage"]["selected_tokens"] == len(result["token_ids"]) <= 30
    assert result["finish_reason"] in ("stop_sequence", "max_output_tokens", "eos")


def test_cli_generate_beams_are_sorted_by_score_and_replay(tmp_path):
    record = str(tmp_path / "beam.json")
    out = cli("generate", "--prompt", "import os", "--num-beams", "3", "--max-tokens", "12",
              "--length-penalty", "0.5", "--json", "--record", record)
    assert out.returncode == 0, out.stderr
    beams = json.loads(out.stdout)["beams"]
    assert len(beams) == 3
    assert [b["score"] for b in beams] == sorted((b["score"] for b in beams), reverse=True)
    with open(record) as f:
        sampling = json.load(f)["sampling"]
    assert sampling["num_beams"] == 3 and sampling["length_penalty"] == 0.5
    again = cli("replay", record)
    assert again.returncode == 0, again.stdout + again.stderr


def test_cli_bad_flag_value_names_the_field():
    out = cli("generate", "--prompt", "x", "--top-p", "1.5")
    assert out.returncode != 0 and "top_p" in out.stderr


def test_cli_generate_speculative_greedy_equals_plain():
    args = ("generate", "--prompt", "def add(a, b):", "--max-tokens", "16", "--temperature", "0",
            "--json")
    plain = cli(*args)
    assert plain.returncode == 0, plain.stderr
    for drafter in ("prompt_lookup", "demo-draft"):
        out = cli(*args, "--speculative", drafter, "--num-speculative-tokens", "3")
        assert out.returncode == 0, out.stderr
        result, want = json.loads(out.stdout), json.loads(plain.stdout)
        assert (result["text"], result["token_ids"]) == (want["text"], want["token_ids"])
        stats = result["speculative"]
        assert stats["proposed"] == 3 * stats["iterations"] > 0
        assert stats["mean_accepted_length"] >= 1.0


def test_cli_speculative_bad_flags_are_named():
    for args, flag in ((("--speculative", "nope"), "--speculative"),
                       (("--num-speculative-tokens", "2"), "--num-speculative-tokens"),
                       (("--speculative", "prompt_lookup", "--num-speculative-tokens", "0"),
                        "--num-speculative-tokens"),
                       (("--speculative", "prompt_lookup", "--ngram-min", "3", "--ngram-max",
                         "2"), "--ngram-min"),
                       (("--speculative", "demo-draft", "--ngram-max", "2"), "--ngram-max")):
        out = cli("generate", "--prompt", "x", *args)
        assert out.returncode != 0 and out.stderr.startswith(flag + ":"), (args, out.stderr)
        assert "Traceback" not in out.stderr
    out = cli("serve", "--speculative", "prompt_lookup", "--record-dir", "records")
    assert out.returncode != 0 and out.stderr.startswith("--record-dir:"), out.stderr


def test_cli_speculative_draft_directory_and_vocabulary_check(tiny_hf_checkpoint):
    tiny = str(tiny_hf_checkpoint("llama"))
    out = cli("generate", "--model", tiny, "--prompt", "the quick", "--max-tokens", "6",
              "--temperature", "0", "--json", "--speculative", tiny)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["speculative"]["iterations"] > 0
    for args in (("--speculative", tiny), ("--model", tiny, "--speculative", "demo-draft")):
        out = cli("generate", "--prompt", "x", *args)
        assert out.returncode != 0 and out.stderr.startswith("--speculative:"), out.stderr
        assert "tokenizer" in out.stderr and "Traceback" not in out.stderr


def test_cli_serve_limit_flags_are_checked_and_named():
    for flag, value in (("--max-num-beams", "0"), ("--max-constraint-compile-s", "0")):
        out = cli("serve", flag, value)
        assert out.returncode != 0 and out.stderr.startswith(flag + ":"), out.stderr
        assert "Traceback" not in out.stderr


def test_python_m_serving_takes_the_flags_of_jaxdecode_serve():
    """The load test starts `python -m serving` (serving never runs the CLI): the same flags,
    the same defaults, speculative decoding's included."""
    from jaxdecode.cli import build_parser
    from serving.__main__ import parse_args

    def serve(argv):
        args = vars(build_parser().parse_args(["serve", *argv]))
        return {k: v for k, v in args.items() if k not in ("command", "func")}

    assert vars(parse_args([])) == serve([])
    assert serve([])["warmup"] is None and serve(["--warmup"])["warmup"] == 64
    assert serve(["--warmup", "512"])["warmup"] == 512
    with pytest.raises(SystemExit):
        serve(["--warmup", "0"])
    assert "speculative" in serve([]) and "num_speculative_tokens" in serve([])
    assert serve([])["batch_invariant"] and not serve(["--no-batch-invariant"])["batch_invariant"]
    flags = ["--model", "x", "--max-slots", "3", "--speculative", "prompt_lookup",
             "--no-prefix-cache"]
    assert vars(parse_args(flags)) == serve(flags)


def test_serve_flags_build_one_engine_config():
    """`serve` builds its engine from one `jd.EngineConfig` (issue #39): each flag lands in
    its field, and a bad value is the config's ValueError naming the field."""
    from types import SimpleNamespace

    import jaxdecode as jd
    from serving.__main__ import parse_args
    from serving.server import engine_config

    model = SimpleNamespace(config=SimpleNamespace(max_len=8192))
    args = parse_args(["--max-slots", "3", "--max-queue", "9", "--max-n", "7", "--page-size",
                       "8", "--prefill-chunk", "0", "--no-prefix-cache", "--row-tile", "16",
                       "--decode-steps", "2", "--no-batch-invariant"])
    config = engine_config(args, model, None, None)
    assert isinstance(config, jd.EngineConfig)
    assert (config.max_slots, config.max_len, config.max_queue, config.max_n) == (3, 4096, 9, 7)
    assert (config.page_size, config.prefill_chunk, config.prefix_cache) == (8, None, False)
    assert (config.row_tile, config.decode_steps, config.batch_invariant) == (16, 2, False)
    assert config.model_source == "demo"
    with pytest.raises(ValueError, match="max_slots"):
        engine_config(parse_args(["--max-slots", "0"]), model, None, None)
