"""Hook points, activation capture and interventions (issue #16, jaxdecode/device/hooks.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
import models
from jaxdecode.model_api import hidden_state_point, hook_points
from tests.scripted import ScriptedModel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ["the quick brown fox", "hello world this is a test"]


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def tiny():
    cfg = models.LlamaConfig(vocab_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                             head_dim=8, max_len=128, hidden_size=32, intermediate_size=64,
                             eos_token_ids=(1,))
    model = models.Llama(cfg)
    return model, model.init_params(jax.random.key(0), scale=0.3)


@functools.lru_cache(maxsize=None)
def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gpt2"])
def test_captured_hidden_states_match_hf_output_hidden_states(tiny_hf_checkpoint, name):
    path = tiny_hf_checkpoint(name)
    model, params, tok = models.load(path)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    layers = model.config.num_layers
    points = [hidden_state_point(i, layers) for i in range(layers + 1)]
    acts = jd.capture_activations(model, params, prompts, points)
    hf = _hf_model(str(path))
    for r, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p]), output_hidden_states=True).hidden_states
        assert len(ref) == layers + 1
        for i, point in enumerate(points):
            np.testing.assert_allclose(acts[point][r, :len(p)], ref[i][0].numpy(), atol=1e-4,
                                       rtol=1e-4, err_msg=f"{name} row {r} {point}")
            assert (acts[point][r, len(p):] == 0).all()


def test_generate_hidden_states_are_those_of_the_choosing_position(tiny):
    model, params = tiny
    prompts = [[5, 6, 7, 8], [20, 21]]
    out = jd.generate(model, params, prompts, jd.SamplingParams(seed=0, max_tokens=6),
                      return_hidden_states=(0, 2, 3, "resid.2"))
    assert set(out.hidden_states) == {0, 2, 3, "resid.2"}
    for r, p in enumerate(prompts):
        seq = p + out.tokens(r)
        acts = jd.capture_activations(model, params, [seq], ["embed", "resid.1", "final_norm",
                                                             "resid.2"])
        for key, point in ((0, "embed"), (2, "resid.1"), (3, "final_norm"),
                           ("resid.2", "resid.2")):
            got = out.hidden_states[key][r]
            assert got.shape == (6, 32) and got.dtype == np.float32
            for t in range(out.lengths[r]):  # step t + 1 chose from position len(p) + t - 1
                np.testing.assert_allclose(got[t], acts[point][0, len(p) + t - 1], atol=1e-4,
                                           err_msg=f"row {r} step {t + 1} {key}")
            assert (got[out.lengths[r]:] == 0).all()


def test_hook_points_are_named_for_every_family(tiny):
    model, params = tiny
    assert hook_points(3) == ("embed", "resid.0", "resid.1", "resid.2", "final_norm")
    seen = []

    def hook(name, x):
        seen.append((name, x.shape))
        return x

    tokens = jnp.array([[5, 6, 7]], jnp.int32)
    gpt2 = models.GPT2(models.GPT2Config(vocab_size=96, num_layers=2, num_heads=2,
                                         num_kv_heads=2, head_dim=8, max_len=32, hidden_size=16,
                                         intermediate_size=32))
    for m, p in ((model, params), (gpt2, gpt2.init_params(jax.random.key(1)))):
        seen.clear()
        plain = m.logits(p, tokens)
        hooked = m.logits(p, tokens, hook=hook)
        np.testing.assert_array_equal(plain, hooked)
        assert [n for n, _ in seen] == list(hook_points(m.config.num_layers))
        assert all(s == (1, 3, m.config.hidden_size) for _, s in seen)
    demo, demo_params, _ = models.demo()
    points = hook_points(demo.config.num_layers)
    acts = jd.capture_activations(demo, demo_params, [[5, 6, 7]], points)
    assert list(acts) == list(points)
    assert all(a.shape == (1, 3, demo.config.hidden_size) for a in acts.values())


# -- interventions -----------------------------------------------------------------------------

def test_zero_steering_vector_changes_nothing(tiny):
    model, params = tiny
    prompts = [[5, 6, 7, 8], [20, 21]]
    sp = [jd.SamplingParams(seed=0, max_tokens=12), jd.SamplingParams(temperature=0.0,
                                                                      max_tokens=12)]
    base = jd.generate(model, params, prompts, sp, return_logits=True)
    for point in ("embed", "resid.1", "final_norm"):
        out = jd.generate(model, params, prompts, sp, return_logits=True,
                          interventions=[jd.steer(point, np.zeros(32), scale=3.0)])
        np.testing.assert_array_equal(out.token_ids, base.token_ids)
        np.testing.assert_array_equal(out.logits, base.logits)


def test_rows_without_intervention_are_bit_identical(tiny):
    model, params = tiny
    prompts = [[5, 6, 7, 8], [20, 21], [9, 9, 9]]
    sp = jd.SamplingParams(seed=3, max_tokens=12, ignore_eos=True)
    base = jd.generate(model, params, prompts, sp, return_logits=True)
    vector = np.random.default_rng(0).normal(size=32).astype(np.float32) * 4
    out = jd.generate(model, params, prompts, sp, return_logits=True,
                      interventions=[jd.steer("resid.0", vector, scale=[0.0, 2.0, 0.0]),
                                     jd.ablate("resid.1", vector, rows=[False, False, True])])
    np.testing.assert_array_equal(out.token_ids[0], base.token_ids[0])
    np.testing.assert_array_equal(out.logits[0], base.logits[0])
    assert not np.array_equal(out.logits[1, 0], base.logits[1, 0])   # steered
    assert not np.array_equal(out.logits[2, 0], base.logits[2, 0])   # ablated


def test_steering_adds_the_scaled_vector_and_ablation_removes_the_direction(tiny):
    model, params = tiny
    prompts = [[5, 6, 7, 8], [20, 21, 22, 23]]
    rng = np.random.default_rng(1)
    vector, direction = rng.normal(size=(2, 32)).astype(np.float32)
    before = jd.capture_activations(model, params, prompts, ["resid.0", "resid.1"])
    steered = jd.capture_activations(model, params, prompts, ["resid.0"],
                                     interventions=[jd.steer("resid.0", vector, [0.5, -2.0])])
    for r, scale in enumerate((0.5, -2.0)):
        np.testing.assert_allclose(steered["resid.0"][r], before["resid.0"][r] + scale * vector,
                                   atol=1e-5)
    ablated = jd.capture_activations(model, params, prompts, ["resid.1"],
                                     interventions=[jd.ablate("resid.1", direction)])
    unit = direction / np.linalg.norm(direction)
    assert np.abs(before["resid.1"] @ unit).max() > 0.1
    np.testing.assert_allclose(ablated["resid.1"] @ unit, 0.0, atol=1e-5)


def double(x, args):
    return x * args


def test_custom_intervention_and_no_recompile_for_new_values(tiny):
    model, params = tiny
    prompts = [[5, 6, 7, 8], [20, 21]]
    sp = jd.SamplingParams(temperature=0.0, max_tokens=8)

    def run(vector, scale, factor):
        return jd.generate(model, params, prompts, sp, return_hidden_states=("resid.0",),
                           interventions=[jd.steer("resid.0", vector, scale),
                                          jd.Intervention("resid.0", double, np.float32(factor))])

    a = run(np.ones(32), [1.0, 0.0], 1.0)
    before = jd.compilation_count()
    b = run(np.zeros(32), [0.0, 0.0], 2.0)
    c = run(np.zeros(32), [0.0, 0.0], 1.0)
    assert jd.compilation_count() == before
    base = jd.generate(model, params, prompts, sp, return_hidden_states=("resid.0",))
    np.testing.assert_array_equal(c.hidden_states["resid.0"], base.hidden_states["resid.0"])
    np.testing.assert_allclose(b.hidden_states["resid.0"][:, 0],
                               2 * base.hidden_states["resid.0"][:, 0], rtol=1e-6)
    np.testing.assert_allclose(a.hidden_states["resid.0"][0, 0],
                               base.hidden_states["resid.0"][0, 0] + 1.0, rtol=1e-6)
    np.testing.assert_array_equal(a.hidden_states["resid.0"][1], base.hidden_states["resid.0"][1])


def test_bad_hooks_name_the_field(tiny):
    model, params = tiny
    sp = jd.SamplingParams(max_tokens=3)
    with pytest.raises(ValueError, match="interventions"):
        jd.generate(model, params, [[5]], sp, interventions=[jd.steer("resid.7", np.zeros(32))])
    with pytest.raises(ValueError, match=r"interventions\[0\]"):
        jd.generate(model, params, [[5]], sp, interventions=[np.zeros(32)])
    with pytest.raises(ValueError, match="interventions"):
        jd.generate(model, params, [[5]], jd.SamplingParams(n=2, max_tokens=3),
                    interventions=[jd.steer("embed", np.zeros(32))])
    with pytest.raises(ValueError, match=r"interventions\[0\]"):
        jd.generate(model, params, [[5]], sp,
                    interventions=[jd.Intervention("embed", lambda x, a: x[..., :3])])
    with pytest.raises(ValueError, match="vector"):
        jd.steer("embed", np.zeros((2, 32)))
    scripted = ScriptedModel.make([3] * 8)
    with pytest.raises(ValueError, match="return_hidden_states: ScriptedModel has no hook"):
        jd.generate(scripted, {}, [[1]], sp, return_hidden_states=(0,))
    with pytest.raises(ValueError, match="points"):
        jd.capture_activations(model, params, [[5]], ["layer3"])
