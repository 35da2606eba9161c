"""The `jaxdecode` command on the embedded demo model, in fresh processes."""

import json
import os
import subprocess
import sys

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
