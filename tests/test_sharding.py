"""Sharding (models/sharding.py, LLM(mesh=)): the rules place leaves as written, and sharded
decoding gives the same tokens as unsharded. The multi-device checks run in one subprocess with
8 simulated CPU devices (the pytest process has one device)."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

import models
from models import GPT2, GPT2Config, Gemma, GemmaConfig, Llama, LlamaConfig
from models import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MESHES = [(1, 2), (2, 4), (1, 8)]  # (data, model): 2 and 8 devices, both axes, a fallback
NAMES = [f"{d}x{m}" for d, m in MESHES]

SCRIPT = textwrap.dedent(r"""
    import json
    import sys
    import jax
    import jaxdecode as jd
    import models
    from models import Llama, LlamaConfig
    from tests.host_fixtures import byte_level_from_table

    assert jax.device_count() == 8, jax.devices()
    # GQA; intermediate 36 splits over 4 but not 8 (the fallback to replicated)
    cfg = LlamaConfig(vocab_size=256, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=4,
                      max_len=64, hidden_size=32, intermediate_size=36, eos_token_ids=(1,))
    model = Llama(cfg)
    params = model.init_params(jax.random.key(0), scale=0.3)
    tok = byte_level_from_table({})
    prompts = [[5, 6, 7], [9, 10], [40, 41, 42, 43], [3]]
    greedy = jd.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                               utf8_errors="replace")
    sampled = jd.SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True,
                                utf8_errors="replace")
    with_logprobs = jd.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                      utf8_errors="replace", logprobs=2)  # the top-k step
    reqs = [with_logprobs, sampled, greedy, sampled]

    def spec(x):
        if not hasattr(x.sharding, "spec"):
            return None
        return [list(e) if isinstance(e, tuple) else e for e in x.sharding.spec]

    def engine(p, mesh):
        with jd.LLM(model, p, tok, max_slots=4, max_len=64, mesh=mesh) as llm:
            done = llm.generate(prompts, reqs)
            outs = [list(o.token_ids) for o in done]
            assert [e.token_id for e in done[0].logprobs] == outs[0]
            st = llm._core.runner.state
            return outs, {"k": spec(st.cache.k), "lengths": spec(st.cache.lengths),
                          "page_table": spec(st.cache.page_table),
                          "last_token": spec(st.last_token)}

    out = {"reference": jd.generate(model, params, prompts, greedy).token_ids.tolist(),
           "engine_reference": engine(params, None)[0]}
    for data, model_axis in json.loads(sys.argv[1]):
        mesh = models.make_mesh(data, model_axis)
        sp = models.shard_params(params, mesh)
        name = f"{data}x{model_axis}"
        out[name] = {
            "params": {k: spec(v) for k, v in sp["layers"][0].items()},
            "embed": spec(sp["embed"]), "lm_head": spec(sp["lm_head"]),
            "ndev": len(sp["layers"][0]["q"].sharding.device_set),
            "generate": jd.generate(model, sp, prompts, greedy).token_ids.tolist(),
        }
        out[name]["engine"], out[name]["state"] = engine(sp, mesh)

    # the embedded demo model (8 query / 4 KV heads) on tensor-parallel meshes of 2 and 4 (the
    # engine's mesh path is the same code, checked on the model above)
    model, params, demo_tok = models.demo()
    prompts = [demo_tok.encode(t).ids for t in ("def fibonacci(n):", "import os\n", "class A:")]
    greedy = jd.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                               utf8_errors="replace")
    out["demo"] = {"reference": jd.generate(model, params, prompts, greedy).token_ids.tolist()}
    for n in (2, 4):
        mesh = models.make_mesh(1, n)
        sp = models.shard_params(params, mesh)
        out["demo"][f"1x{n}"] = {
            "params": {k: spec(v) for k, v in sp["layers"][0].items()},
            "replicated": models.sharding.unmatched(params),
            "generate": jd.generate(model, sp, prompts, greedy).token_ids.tolist()}
    print("RESULT" + json.dumps(out))
""")


def _run_on_8_devices(script: str, args: list, timeout: int) -> dict:
    """The RESULT json of `script` run with `args` in a subprocess with 8 simulated devices."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                          " --xla_force_host_platform_device_count=8").strip())
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


@pytest.fixture(scope="module")
def mesh_run():
    return _run_on_8_devices(SCRIPT, [json.dumps(MESHES)], 600)


def test_rules_place_params_2x4(mesh_run):
    r = mesh_run["2x4"]
    assert r["ndev"] == 8
    p = r["params"]
    for name in ("q", "k", "v", "gate", "up"):
        assert p[name] == [None, "model"], name
    assert p["o"] == ["model"] and p["down"] == ["model"]
    assert p["attn_norm"] == [] and p["mlp_norm"] == []
    assert r["embed"] == ["model"] and r["lm_head"] == [None, "model"]


def test_rules_fall_back_to_replicated_1x8(mesh_run):
    p = mesh_run["1x8"]["params"]
    assert p["q"] == [None, "model"] and p["k"] == [None, "model"]  # 32 and 16 split 8 ways
    assert p["gate"] == [] and p["up"] == [] and p["down"] == []     # 36 does not
    # 4 kv heads over 8 devices: the paged pool is replicated along heads
    assert mesh_run["1x8"]["state"]["k"] == []


def test_sharded_generate_matches_unsharded(mesh_run):
    for name in NAMES:  # meshes 1x2, 2x4 and 1x8
        assert mesh_run[name]["generate"] == mesh_run["reference"], name


@pytest.mark.parametrize("name", ["1x2", "1x4"])
def test_demo_model_shards_over_2_and_4_devices(mesh_run, name):
    demo = mesh_run["demo"]
    r = demo[name]
    for leaf in ("q", "k", "v", "gate", "up"):  # 8 query / 4 KV heads: every projection splits
        assert r["params"][leaf] == [None, "model"], leaf
    assert r["params"]["o"] == ["model"] and r["params"]["down"] == ["model"]
    assert r["replicated"] == []
    assert r["generate"] == demo["reference"]


def test_engine_with_mesh_matches_and_shards_the_cache(mesh_run):
    assert all(len(t) == 8 for t in mesh_run["engine_reference"])
    for name in NAMES:
        assert mesh_run[name]["engine"] == mesh_run["engine_reference"], name
    state = mesh_run["2x4"]["state"]
    # the engine's paged pool holds no row: kv heads on "model", pages replicated over "data";
    # the per-row page table and lengths put the batch on "data"
    assert state["k"] == ["model"]
    assert state["lengths"] == ["data"] and state["page_table"] == ["data"]


@pytest.mark.parametrize("model", [
    Llama(LlamaConfig(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_len=32, hidden_size=32, intermediate_size=64, attention_bias=True)),
    Llama(LlamaConfig(vocab_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_len=32, hidden_size=32, intermediate_size=64,
                      tie_word_embeddings=True)),
    GPT2(GPT2Config(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8,
                    max_len=32, hidden_size=32, intermediate_size=64,
                    tie_word_embeddings=False)),
    Llama(LlamaConfig(vocab_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_len=32, hidden_size=32, intermediate_size=64, qk_norm=True)),
    Gemma(GemmaConfig(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_len=32, hidden_size=32, intermediate_size=64, qk_norm=True,
                      layer_types=("sliding_attention", "full_attention"), sliding_window=4)),
], ids=["llama-bias", "llama-tied", "gpt2", "qwen3", "gemma3"])
def test_rules_cover_every_param(model):
    shapes = jax.eval_shape(model.init_params, jax.random.key(0))
    assert sharding.unmatched(shapes) == []
    mesh = AbstractMesh((2, 4), ("data", "model"))  # rules only need axis names and sizes
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    specs = {sharding.key_path(p): sharding.param_spec(sharding.key_path(p), s.shape, mesh)
             for p, s in flat}
    assert specs["layers/0/q"] == P(None, "model") and specs["layers/0/o"] == P("model")
    assert specs["embed"] == P("model")
    if isinstance(model, GPT2):
        assert specs["layers/1/fc"] == P(None, "model") and specs["layers/1/fc_bias"] == P("model")
        assert specs["layers/1/proj"] == P("model") and specs["layers/1/proj_bias"] == P()
        assert specs["pos_embed"] == P() and specs["final_norm_bias"] == P()
        assert specs["lm_head"] == P(None, "model")
    elif getattr(model.config, "qk_norm", False):
        assert specs["layers/0/q_norm"] == P() and specs["layers/0/k_norm"] == P()
    elif model.config.attention_bias:
        assert specs["layers/0/k_bias"] == P("model") and specs["layers/0/down"] == P("model")


def test_cache_rule_and_fallback():
    from jaxdecode.model_api import CACHE_RULES, fit_spec, match_rules
    mesh = AbstractMesh((2, 4), ("data", "model"))
    rule = match_rules(sharding.RULES, "cache/k")
    assert rule == match_rules(CACHE_RULES, "cache/k")  # one table
    assert fit_spec(rule, (2, 8, 4, 16, 8), mesh) == P(None, "data", "model")
    assert fit_spec(rule, (2, 3, 2, 16, 8), mesh) == P()  # neither divides: replicated
    assert fit_spec(("model",), (6,), AbstractMesh((3,), ("data",))) == P()  # axis missing


def test_parse_mesh_and_serve_flag():
    mesh = sharding.parse_mesh("data=1,model=1")
    assert dict(mesh.shape) == {"data": 1, "model": 1}
    assert dict(sharding.parse_mesh("").shape) == {"data": 1, "model": jax.device_count()}
    for bad in ("foo=2", "data=x", f"data={jax.device_count() + 1}"):
        with pytest.raises(ValueError):
            sharding.parse_mesh(bad)
    from jaxdecode.cli import build_parser
    args = build_parser().parse_args(["serve", "--mesh", "data=1,model=1"])
    assert args.mesh == "data=1,model=1"


# The start of both family scripts: a byte tokenizer, 8 greedy tokens, three ragged prompts.
_FAMILY_SETUP = textwrap.dedent(r"""
    import json
    import sys
    import jax
    import jaxdecode as jd
    import models
    from tests.host_fixtures import byte_level_from_table

    tok = byte_level_from_table({})
    greedy = jd.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                               utf8_errors="replace")
    prompts = [[5, 6, 7, 8, 9, 10], [9, 10], [40, 41, 42, 43]]
    out = {}
""")


FAMILY_SCRIPT = _FAMILY_SETUP + textwrap.dedent(r"""
    assert jax.device_count() == 8, jax.devices()
    for path in sys.argv[1:]:
        model, params, _ = models.load(path)
        row = {"reference": jd.generate(model, params, prompts, greedy).token_ids.tolist()}
        for data, model_axis in ((1, 2), (4, 2)):   # 2 kv heads: "model" of 2
            mesh = models.make_mesh(data, model_axis)
            sp = models.shard_params(params, mesh)
            row[f"{data}x{model_axis}"] = jd.generate(model, sp, prompts, greedy).token_ids.tolist()
            with jd.LLM(model, sp, tok, max_slots=4, max_len=32, mesh=mesh) as llm:
                done = llm.generate(prompts, greedy)
                row[f"{data}x{model_axis}-engine"] = [list(o.token_ids) for o in done]
        row["unmatched"] = models.sharding.unmatched(params)
        out[path] = row
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.parametrize("families", [
    ("gemma3",),  # the most of the new pieces: q/k norms, soft-caps, local/global rope
    pytest.param(("qwen3", "gemma2", "phi3"), marks=pytest.mark.exhaustive)])
def test_new_families_shard_like_one_device(tiny_hf_checkpoint, families):
    """Qwen3, Gemma 2, Gemma 3 and Phi-3 (tiny HF checkpoints) on 8 simulated devices, meshes
    1x2 and 4x2: greedy tokens of jd.generate and of the engine equal one device's (Gemma 3
    by default, the rest with the exhaustive variants; every family's rules: below)."""
    paths = [str(tiny_hf_checkpoint(n)) for n in families]
    for path, row in _run_on_8_devices(FAMILY_SCRIPT, paths, 900).items():
        assert row["unmatched"] == [], path
        assert all(len(t) == 8 for t in row["reference"]), path
        for mesh in ("1x2", "4x2"):
            assert row[mesh] == row["reference"], (path, mesh)
            assert row[f"{mesh}-engine"] == row["reference"], (path, mesh)


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "phi3", "mixtral",
                                    "qwen3_moe"])
def test_rules_place_every_parameter_of_every_new_family(tiny_hf_checkpoint, family):
    """Every leaf of each new family (Phi-3's split fused weights, Gemma's extra norms, MoE
    experts and router) matched by a rule of the sharding table: none replicated by default."""
    _, params, _ = models.load(str(tiny_hf_checkpoint(family)))
    assert sharding.unmatched(params) == []


MOE_SCRIPT = _FAMILY_SETUP + textwrap.dedent(r"""
    for path in sys.argv[1:]:
        model, params, _ = models.load(path)
        mesh = models.make_mesh(1, 2, devices=jax.devices()[:4], expert=2)
        sp = models.shard_params(params, mesh)
        layer = sp["layers"][0]
        with jd.LLM(model, sp, tok, max_slots=4, max_len=32, mesh=mesh) as llm:
            engine = [list(o.token_ids) for o in llm.generate(prompts, greedy)]
        out[path] = {
            "reference": jd.generate(model, params, prompts, greedy).token_ids.tolist(),
            "sharded": jd.generate(model, sp, prompts, greedy).token_ids.tolist(),
            "engine": engine, "mesh": dict(mesh.shape),
            "specs": {k: [list(e) if isinstance(e, tuple) else e for e in layer[k].sharding.spec]
                      for k in ("experts_gate", "experts_up", "experts_down", "router")},
            "devices": len(layer["experts_gate"].sharding.device_set),
            "unmatched": models.sharding.unmatched(params)}
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.parametrize("family", ["mixtral",
                                    pytest.param("qwen3_moe", marks=pytest.mark.exhaustive)])
def test_moe_on_an_expert_axis_of_2_matches_one_device(tiny_hf_checkpoint, family):
    """Mixtral (and, exhaustive, Qwen3-MoE) on a mesh data=1, expert=2, model=2 of 4 simulated
    devices: the experts split over "expert" (each expert's F over "model"), and the greedy
    tokens of jd.generate and of the engine equal one device's."""
    paths = [str(tiny_hf_checkpoint(family))]
    for path, row in _run_on_8_devices(MOE_SCRIPT, paths, 600).items():
        assert row["mesh"] == {"data": 1, "expert": 2, "model": 2}
        assert row["unmatched"] == [] and row["devices"] == 4, path
        assert row["specs"]["experts_gate"] == ["expert", None, "model"], path
        assert row["specs"]["experts_up"] == ["expert", None, "model"], path
        assert row["specs"]["experts_down"] == ["expert", "model"], path
        assert row["specs"]["router"] == [], path
        assert all(len(t) == 8 for t in row["reference"]), path
        assert row["sharded"] == row["reference"] and row["engine"] == row["reference"], path


def test_parse_mesh_expert_axis():
    mesh = sharding.parse_mesh("expert=1,model=1")
    assert dict(mesh.shape) == {"data": 1, "model": 1}   # an expert axis of 1 is left out
    with pytest.raises(ValueError, match="expert"):
        sharding.make_mesh(1, 1, expert=0)
