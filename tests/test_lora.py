"""Multi-LoRA (contract R6, R7): PEFT adapters on a tiny random Llama, against Hugging Face PEFT
(PyTorch) greedy generation; mixed batches, compilations, prefix cache, records, serving."""

from __future__ import annotations

import json

import numpy as np
import pytest

import jaxdecode as jd
import models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROMPTS = ["the quick brown fox", "hello world this is a test"]
NEW_TOKENS = 8
# adapter name: (r, lora_alpha, targets, use_rslora, seed); "wide" touches every projection
ADAPTERS = {"attn": (4, 8, ["q_proj", "v_proj", "o_proj"], False, 1),
            "wide": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj"], True, 2)}


def _hf_base(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def _make_adapter(base_path, out, r, alpha, targets, rslora, seed):
    """A PEFT LoRA adapter with random A and B (PEFT starts B at zero: no effect)."""
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                             use_rslora=rslora)
    model = peft.get_peft_model(_hf_base(base_path), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def setup(tiny_hf_checkpoint, tmp_path_factory):
    """(base path, {name: adapter path}, model, params, tokenizer, prompt ids)."""
    base = tiny_hf_checkpoint("llama")
    root = tmp_path_factory.mktemp("lora")
    paths = {name: _make_adapter(base, root / name, *spec) for name, spec in ADAPTERS.items()}
    model, params, tok = models.load(base)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    return base, paths, model, params, tok, ids


@pytest.fixture(scope="module")
def banned(setup):
    """Ids past the tokenizer (the random model may pick them; they decode to nothing)."""
    tok = setup[4]
    return tuple(range(len(tok), setup[2].config.vocab_size))


@pytest.fixture(scope="module")
def reference(setup, banned):
    """HF PEFT greedy tokens {adapter or None: [tokens per prompt]}."""
    base, paths, *_, ids = setup
    out = {}
    for name in (None, *paths):
        model = _hf_base(base)
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, paths[name]).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        rows = []
        for p in ids:
            with torch.no_grad():
                gen = model.generate(input_ids=torch.tensor([p]),
                                     attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     do_sample=False, max_new_tokens=NEW_TOKENS,
                                     bad_words_ids=[[i] for i in banned])
            rows.append(gen[0, len(p):].tolist())
        out[name] = rows
    return out


@pytest.fixture(scope="module")
def llm(setup):
    _, paths, model, params, tok, _ = setup
    engine = jd.LLM(model, params, tok, max_slots=8, max_len=64, prefill_chunk=16, page_size=8,
                    lora_modules=paths, max_loras=3)
    yield engine
    engine.close()


def _sp(banned, lora=None, **kw):
    return jd.SamplingParams(**{"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True,
                                "banned_token_ids": banned, "lora": lora, **kw})


def test_adapters_change_the_reference_tokens(reference):
    """The adapters matter: each one's HF tokens differ from the base model's (so the parity
    below can fail)."""
    for name in ADAPTERS:
        assert reference[name] != reference[None], name


def test_greedy_tokens_match_hf_peft_alone_R6(llm, setup, reference, banned):
    ids = setup[-1]
    for name in (None, *ADAPTERS):
        got = [list(c.token_ids) for c in llm.generate(ids, _sp(banned, name))]
        assert got == reference[name], name


def test_mixed_batch_matches_hf_peft_without_compiling_R6(llm, setup, reference, banned):
    """Base and adapter rows in one batch give each its own reference tokens; a new mix of
    selections compiles nothing."""
    ids = setup[-1]
    names = [None, "attn", "wide", "wide", None, "attn"]
    prompts = [ids[i % 2] for i in range(len(names))]
    got = llm.generate(prompts, [_sp(banned, n) for n in names])
    for i, (n, c) in enumerate(zip(names, got)):
        assert list(c.token_ids) == reference[n][i % 2], (i, n)
    before = jd.compilation_count()
    names = ["wide", "attn", None, "attn", "wide", None]
    got = llm.generate(prompts, [_sp(banned, n) for n in names])
    assert jd.compilation_count() == before
    for i, (n, c) in enumerate(zip(names, got)):
        assert list(c.token_ids) == reference[n][i % 2], (i, n)


def test_beam_search_on_an_adapter_matches_hf_peft_beams_R6(llm, setup):
    """A beam request selecting an adapter (a call mixing it with a base row) returns PEFT's
    `generate(num_beams=3, num_return_sequences=2)` beams and scores; the base row the base
    model's."""
    base, paths, *_, ids = setup
    want = {}
    for name in (None, "wide"):
        model = _hf_base(base)
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, paths[name]).eval()
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids[0]]),
                                 attention_mask=torch.ones(1, len(ids[0]), dtype=torch.long),
                                 do_sample=False, num_beams=3, num_return_sequences=2,
                                 max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
                                 return_dict_in_generate=True, output_scores=True)
        want[name] = ([out.sequences[j, len(ids[0]):].tolist() for j in range(2)],
                      out.sequences_scores.tolist())
    assert want["wide"][0] != want[None][0]
    sp = lambda lora: jd.SamplingParams(num_beams=3, n=2, max_tokens=NEW_TOKENS,  # noqa: E731
                                        ignore_eos=True, lora=lora, utf8_errors="replace")
    got = llm.generate([ids[0], ids[0]], [sp("wide"), sp(None)])
    for name, pair in (("wide", got[:2]), (None, got[2:])):
        assert [list(c.token_ids) for c in pair] == want[name][0], name
        np.testing.assert_allclose([c.score for c in pair], want[name][1], atol=1e-4,
                                   err_msg=str(name))


def test_speculative_engine_on_adapters_matches_hf_peft_R6(setup, reference, banned):
    """Speculative decoding (prompt lookup, k = 3) on an engine with adapters: a batch mixing
    both adapters and the base gives each row PEFT's greedy tokens (the target verifies with
    the row's adapter; greedy rows keep exactly the target's argmax, contract §10)."""
    _, paths, model, params, tok, ids = setup
    names = [None, "attn", "wide", "wide", None, "attn"]
    with jd.LLM(model, params, tok, max_slots=8, max_len=64, prefill_chunk=16, page_size=8,
                lora_modules=paths, max_loras=3,
                speculative={"draft": "prompt_lookup", "k": 3}) as spec:
        got = spec.generate([ids[i % 2] for i in range(len(names))],
                            [_sp(banned, n) for n in names])
    for i, (n, c) in enumerate(zip(names, got)):
        assert list(c.token_ids) == reference[n][i % 2], (i, n)


def test_prefix_cache_keys_on_the_adapter_R7(llm, setup, reference, banned):
    """A prompt cached under one adapter is not served to another (or to the base); under the
    same adapter it is."""
    tok = setup[4]
    prompt = tok(" ".join(PROMPTS * 3), add_special_tokens=False)["input_ids"][:40]
    assert len(prompt) > 32
    runs = {}
    for name in ("attn", "wide", None, "attn"):
        hits = llm.kv_stats()["prefix_cache_hits"]
        c = llm.generate([prompt], _sp(banned, name))[0]
        runs.setdefault(name, []).append((list(c.token_ids),
                                          llm.kv_stats()["prefix_cache_hits"] - hits))
    assert [h for _, h in runs["attn"]] == [0, 32]
    assert runs["wide"][0][1] == 0 and runs[None][0][1] == 0
    assert runs["attn"][0][0] == runs["attn"][1][0]
    assert len({str(runs[n][0][0]) for n in runs}) == 3  # three models, three outputs


def test_records_name_the_adapter_and_replay_uses_it_R7(llm, setup, banned):
    ids = setup[-1]
    record = llm.generate([ids[0]], _sp(banned, "wide", seed=3, temperature=0.8))[0].record
    lora = record.data["model"]["lora"]
    assert lora["name"] == "wide" and lora["hash"] == llm.adapters.hashes["wide"]
    assert record.data["sampling"]["lora"] == "wide"
    report = jd.replay(jd.GenerationRecord.from_json(record.to_json()), llm)
    assert report.identical and report.environment_differences == []
    # a record that names another adapter's weights is listed
    record.data["model"]["lora"] = dict(lora, hash="0" * 64)
    assert any(d.startswith("lora:") for d in jd.replay(record, llm).environment_differences)


def test_bad_selections_and_families_are_value_errors(llm, setup, banned, tiny_hf_checkpoint):
    ids = setup[-1]
    with pytest.raises(ValueError, match="^lora: unknown adapter 'nope'"):
        llm.submit(ids[0], _sp(banned, "nope"))
    with pytest.raises(ValueError, match="^lora:"):
        jd.SamplingParams(lora="")
    _, paths, model, params, tok, _ = setup
    with pytest.raises(ValueError, match="^max_loras:"):
        jd.LLM(model, params, tok, max_len=64, lora_modules=paths, max_loras=1)
    with pytest.raises(ValueError, match="^lora_modules: missing: .*adapter_config.json"):
        jd.LLM(model, params, tok, max_len=64, lora_modules={"missing": "/nonexistent"})
    with pytest.raises(ValueError, match="^lora_modules: not supported together with mesh="):
        jd.LLM(model, params, tok, max_len=64, lora_modules=paths, step_hook=object())
    gpt2, gparams, gtok = models.load(tiny_hf_checkpoint("gpt2"))
    with pytest.raises(ValueError, match="^lora_modules: the GPT2 family has no LoRA"):
        jd.LLM(gpt2, gparams, gtok, max_len=64, lora_modules=paths)


def test_http_models_selection_and_404_R6(llm, setup, reference, banned):
    """/v1/models lists the adapters with their parent; `"model": NAME` selects one (the
    response names it); an unknown name is a 404 naming `model`, and the server serves on."""
    import asyncio

    import httpx

    from serving.app import create_app

    app = create_app(llm, model_name="tiny-llama")
    ids = setup[-1]
    bias = {str(i): -100.0 for i in banned}  # -100 or -inf: greedy never picks them

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            models_ = (await c.get("/v1/models")).json()
            card = await c.get("/v1/models/wide")
            answers = [await c.post("/v1/completions", json={
                "model": m, "prompt": ids[1], "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True, "logit_bias": bias}) for m in ("wide", "tiny-llama", "nope")]
            return models_, card, answers

    models_, card, (wide, base, missing) = asyncio.run(go())
    cards = {m["id"]: m for m in models_["data"]}
    assert set(cards) == {"tiny-llama", "attn", "wide"}
    assert cards["attn"]["parent"] == "tiny-llama" and "parent" not in cards["tiny-llama"]
    assert card.status_code == 200 and card.json()["parent"] == "tiny-llama"
    assert wide.status_code == 200 and base.status_code == 200, (wide.text, base.text)
    assert wide.json()["model"] == "wide" and base.json()["model"] == "tiny-llama"
    for answer, name in ((wide, "wide"), (base, None)):  # the library's text of that adapter
        want = llm.generate([ids[1]], _sp(banned, name))[0]
        assert list(want.token_ids) == reference[name][1]
        assert answer.json()["choices"][0]["text"] == want.text, name
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_not_found"
    assert "'nope'" in error["message"]


def test_serve_flag_parses_name_path_pairs():
    from serving.server import lora_modules

    assert lora_modules(["a=/x", "b=/y=z"]) == {"a": "/x", "b": "/y=z"}
    assert lora_modules(None) is None
    with pytest.raises(ValueError, match="^lora_modules: expected NAME=PATH"):
        lora_modules(["nopath"])
