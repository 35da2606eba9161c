"""contract §3: the processor pipeline, its order, and parity with Hugging Face's processors."""

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

import jaxdecode as jd

V = 64


def hf_reference(logits, sp: jd.SamplingParams, history):
    """One row through HF's processors in the v1 order (penalty, temperature, k, p, min-p)."""
    scores = torch.tensor(logits[None], dtype=torch.float32)
    ids = torch.tensor([history], dtype=torch.long)
    chain = []
    if sp.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(sp.repetition_penalty))
    if sp.temperature not in (0.0, 1.0):
        chain.append(TemperatureLogitsWarper(sp.temperature))
    if sp.top_k:
        chain.append(TopKLogitsWarper(sp.top_k))
    if sp.top_p < 1.0:
        chain.append(TopPLogitsWarper(sp.top_p))
    if sp.min_p > 0:
        chain.append(MinPLogitsWarper(sp.min_p))
    for proc in chain:
        scores = proc(ids, scores)
    return torch.log_softmax(scores, -1)[0].numpy()


ROWS = [
    jd.SamplingParams(),
    jd.SamplingParams(temperature=0.7, top_k=5),
    jd.SamplingParams(temperature=1.3, top_p=0.8),
    jd.SamplingParams(temperature=0.9, min_p=0.05),
    jd.SamplingParams(repetition_penalty=1.3, top_k=20, top_p=0.9, min_p=0.02, temperature=0.8),
    jd.SamplingParams(repetition_penalty=0.7, temperature=1.1),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_processors_P3_per_row_match_hf(seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(len(ROWS), V)).astype(np.float32) * 3
    history = [rng.integers(0, V, size=7).tolist() for _ in ROWS]
    ours = np.asarray(jd.process_logits(logits, ROWS, output_ids=np.array(history)))
    for r, sp in enumerate(ROWS):
        ref = hf_reference(logits[r], sp, history[r])
        np.testing.assert_array_equal(np.isfinite(ours[r]), np.isfinite(ref), err_msg=f"row {r}")
        fin = np.isfinite(ref)
        np.testing.assert_allclose(ours[r][fin], ref[fin], atol=1e-5, err_msg=f"row {r}")


def test_processors_P3_rows_do_not_affect_each_other():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(3, V)).astype(np.float32)
    alone = np.asarray(jd.process_logits(logits[1:2], ROWS[4]))
    batch = np.asarray(jd.process_logits(logits, [ROWS[1], ROWS[4], ROWS[2]]))
    np.testing.assert_array_equal(alone[0], batch[1])


def test_processors_P3_untruncated_row_keeps_its_tail_beside_truncating_rows():
    rng = np.random.default_rng(9)
    logits = (rng.normal(size=(2, 4096)) * 4).astype(np.float32)  # a long, thin tail
    plain = jd.SamplingParams(temperature=0.7)
    alone = np.asarray(jd.process_logits(logits[:1], plain))
    beside = np.asarray(jd.process_logits(logits, [plain, jd.SamplingParams(top_k=5)]))
    assert np.isfinite(alone).all()
    np.testing.assert_array_equal(beside[0], alone[0])


def test_processors_frequency_presence_openai_semantics():
    logits = np.zeros((1, 8), np.float32)
    history = np.array([[3, 3, 3, 5, -1, -1]])
    sp = jd.SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = np.asarray(jd.process_logits(logits, sp, output_ids=history))[0]
    expected = np.zeros(8)
    expected[3] -= 3 * 0.5 + 0.25
    expected[5] -= 1 * 0.5 + 0.25
    expected -= np.log(np.exp(expected).sum())
    np.testing.assert_allclose(out, expected, atol=1e-6)


def test_processors_P1_bias_then_ban_order_and_version():
    assert jd.PROCESSOR_ORDER == "v1"
    logits = np.zeros((1, 8), np.float32)
    sp = jd.SamplingParams(logit_bias={2: 100.0, 4: 1.0}, banned_token_ids=(2,))
    out = np.asarray(jd.process_logits(logits, sp))[0]
    assert out[2] == -np.inf  # banned beats any bias (step 2 after step 1)
    assert out[4] == out.max()


def test_processors_temperature_zero_is_greedy_branch_without_nan():
    logits = np.array([[1.0, 3.0, 2.0, -1.0]], np.float32)
    out = np.asarray(jd.process_logits(logits, jd.SamplingParams(temperature=0.0, top_p=0.5)))
    assert np.all(~np.isnan(out))
    assert int(np.argmax(out[0])) == 1


def test_processors_P2_everything_banned_gives_all_minus_inf_not_nan():
    logits = np.zeros((1, 4), np.float32)
    out = np.asarray(jd.process_logits(logits, jd.SamplingParams(banned_token_ids=(0, 1, 2, 3))))
    assert np.all(np.isneginf(out))


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.1), ("min_p", 1.1),
    ("top_k", -1), ("repetition_penalty", 0.0), ("max_tokens", 0), ("n", 0), ("stop", ("",)),
    ("output_kind", "stream"), ("utf8_errors", "ignore"), ("seed", -1), ("temperature", float("nan")),
    ("logit_bias", {"x": 1.0}), ("stop_token_ids", ((),)), ("min_tokens", 100),
])
def test_config_invalid_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        jd.SamplingParams(**{field: value})


def test_config_normalises_stop_and_stop_ids():
    sp = jd.SamplingParams(stop="END", stop_token_ids=[7, (1, 2), [3]])
    assert sp.stop == ("END",)
    assert sp.single_stop_ids == (7, 3)
    assert sp.stop_id_sequences == ((1, 2),)
