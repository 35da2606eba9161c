"""The worked examples of the research API (jaxdecode/recipes): the green-list watermark and
its detector, and classifier-free guidance (with parity against HF `guidance_scale`)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
import models
from jaxdecode.recipes import guidance, watermark

KEY = 1234
CODE_PROMPTS = ["def parse(path):\n", "class Config:\n", "import os\nimport sys\n",
                "# utilities\n"]


def test_watermark_green_list_is_the_same_on_device_and_host():
    prev = np.array([0, 1, 17, 4095, 123456], np.int64)
    ids = np.arange(4096)
    host = watermark.is_green(prev[:, None], ids[None, :], KEY, 0.25)
    device = jax.jit(lambda p, i: watermark.is_green(p, i, jnp.uint32(KEY), jnp.float32(0.25),
                                                     jnp))(prev[:, None].astype(np.int32),
                                                           ids[None, :].astype(np.int32))
    np.testing.assert_array_equal(np.asarray(device), host)
    assert abs(host.mean() - 0.25) < 0.01
    assert not np.array_equal(host, watermark.is_green(prev[:, None], ids[None, :], KEY + 1,
                                                       0.25))


def test_watermark_processor_adds_delta_to_green_logits(demo):
    model, params, tok = demo
    ids = [tok.encode(p).ids for p in CODE_PROMPTS[:2]]
    out = jd.generate(model, params, ids, jd.SamplingParams(seed=0, max_tokens=3),
                      processors=[watermark.watermark_processor(KEY, gamma=0.5, delta=3.0)],
                      return_scores=True, return_logits=True)
    for r in range(2):
        prev = [ids[r][-1]] + out.tokens(r)
        for t in range(3):
            green = watermark.is_green(np.full(4096, prev[t]), np.arange(4096), KEY, 0.5)
            shift = out.scores[r, t] - np.asarray(jax.nn.log_softmax(out.logits[r, t]))
            np.testing.assert_allclose(shift[green] - shift[~green].mean(), 3.0, atol=1e-4)


def test_watermark_detector_scores_a_repeated_pair_once():
    """A run of one repeated pair (a line of `~` or `=` in code) is one piece of evidence: by
    default it is scored once, so it cannot push unmarked text past the threshold alone."""
    red = next(t for t in range(1, 4096) if not watermark.is_green(t, t, KEY, 0.25))
    run = [red] * 41                                   # 40 scored pairs, all (red, red)
    every = watermark.detect(run, KEY, ignore_repeats=False)
    assert (every.green, every.scored) == (0, 40) and every.z < -3
    once = watermark.detect(run, KEY)
    assert (once.green, once.scored) == (0, 1) and abs(once.z) < 1
    mixed = watermark.detect([5, 6, 5, 6, 5, 7], KEY)  # pairs (5,6) (6,5) (5,6) (6,5) (5,7)
    assert mixed.scored == 3
    assert mixed.green == int(sum(watermark.is_green(p, t, KEY, 0.25)
                                  for p, t in ((5, 6), (6, 5), (5, 7))))


def test_watermark_detector_separates_watermarked_from_plain_text(demo):
    model, params, tok = demo
    ids = [tok.encode(p).ids for p in CODE_PROMPTS]
    rows = [jd.SamplingParams(temperature=1.0, max_tokens=64, seed=i, ignore_eos=True)
            for i in range(len(ids))]
    plain = jd.generate(model, params, ids, rows)
    marked = jd.generate(model, params, ids, rows,
                         processors=[watermark.watermark_processor(KEY, delta=4.0)])
    before = jd.compilation_count()
    other_key = jd.generate(model, params, ids, rows,
                            processors=[watermark.watermark_processor(99, delta=4.0)])
    assert jd.compilation_count() == before  # the key is data

    def score(out, key):
        return watermark.pooled([watermark.detect(out.tokens(r), key, prev=ids[r][-1])
                                 for r in range(len(ids))])

    assert score(marked, KEY).z > 8
    assert abs(score(plain, KEY).z) < 3
    assert abs(score(marked, KEY + 1).z) < 3       # the key is needed to see it
    assert score(other_key, 99).z > 8 and abs(score(other_key, KEY).z) < 3
    texts = [tok.decode(marked.tokens(r)) for r in range(len(ids))]
    z_text = watermark.pooled([watermark.detect_text(t, tok, KEY) for t in texts]).z
    assert z_text > 6  # re-tokenized text keeps the signal
    with pytest.raises(ValueError, match="gamma"):
        watermark.watermark_processor(KEY, gamma=1.5)
    with pytest.raises(ValueError, match="token_ids"):
        watermark.detect([5], KEY)


@functools.lru_cache(maxsize=None)
def _hf(path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    m = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def test_guidance_matches_hf_guidance_scale(tiny_hf_checkpoint):
    torch = pytest.importorskip("torch")
    path = tiny_hf_checkpoint("llama")
    model, params, _ = models.load(path)
    prompts, negatives = [[5, 9, 17, 33, 40], [7, 8, 100]], [[5, 11], [1]]
    sp = jd.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    hf = _hf(str(path))
    with jax.default_matmul_precision("highest"):
        for scale in (1.5, 3.0):
            ours = guidance.guided_generate(model, params, prompts, negatives, sp, scale=scale)
            assert ours.token_ids.shape == (2, 10)
            for r, p in enumerate(prompts):
                with torch.no_grad():
                    ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                                                                  dtype=torch.long),
                                      do_sample=False, max_new_tokens=10, guidance_scale=scale,
                                      negative_prompt_ids=torch.tensor([negatives[r]]))
                assert ours.tokens(r) == ref[0, len(p):].tolist(), (scale, r)
        plain = jd.generate(model, params, prompts, sp)
        same = guidance.guided_generate(model, params, prompts, negatives, sp, scale=1.0)
        np.testing.assert_array_equal(same.token_ids, plain.token_ids)


def test_guidance_pairs_stay_in_step_when_sampling(demo):
    model, params, tok = demo
    prompts = [tok.encode(p).ids for p in CODE_PROMPTS[:2]]
    negatives = [tok.encode("# TODO\n").ids] * 2
    sp = jd.SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.2, max_tokens=16)
    inter = [p for pair in zip(prompts, negatives) for p in pair]
    rows = [dataclasses.replace(sp, seed=s) for s in (0, 0, 1, 1)]
    out = jd.generate(model, params, inter, rows, processors=guidance.guidance_processors(2.0),
                      return_scores=True)
    np.testing.assert_array_equal(out.token_ids[0::2], out.token_ids[1::2])
    np.testing.assert_array_equal(out.scores[0::2], out.scores[1::2])
    guided = guidance.guided_generate(model, params, prompts, negatives,
                                      [rows[0], rows[2]], scale=2.0)
    np.testing.assert_array_equal(guided.token_ids, out.token_ids[0::2])
    assert len(guided.finish_reasons) == 2
    with pytest.raises(ValueError, match="negative_prompt_ids"):
        guidance.guided_generate(model, params, prompts, negatives[:1], sp)
    with pytest.raises(ValueError, match="pairs"):
        jd.generate(model, params, prompts[:1], sp, processors=guidance.guidance_processors(2.0))
