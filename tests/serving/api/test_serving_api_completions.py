"""Completions that score text, as eval harnesses send them: ``echo`` + ``logprobs`` returns the prompt's token
logprobs (the first null), ``max_tokens=0`` scores the prompt alone, each prompt in one engine request (its
prefill scores it), and a list of prompts gets one choice per prompt and per n; plus ``logit_bias`` through the
sampler."""

import json
import math

import httpx
import numpy as np
import pytest
from helpers.server import LLAMA, MODEL_NAME, make_engine, model_folder, running_server

from serving.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams

TIMEOUT_S = 120
PROMPT = [5, 17, 40, 99, 123, 7, 250]
TOLERANCE = 1e-4  # float32 against HF's float32 logits (the model tests' bound)


def complete(url: str, **fields) -> dict:
    response = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, **fields}, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


def hf_logprobs() -> tuple[list[int], np.ndarray]:
    """(the llama fixture's first prompt, HF transformers' log-softmax of its logits ``[12, 320]``)."""
    with np.load(LLAMA / "reference.npz") as ref:
        ids, logits = ref["input_ids"][0][:ref["lengths"][0]].tolist(), ref["logits"][0][:ref["lengths"][0]]
    return ids, logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)


@pytest.mark.parametrize("max_tokens", [0, 2])
def test_echo_with_logprobs_scores_the_prompt_as_hf_does(api_server, max_tokens):
    ids, reference = hf_logprobs()
    out = complete(api_server.url, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=3, temperature=0.0,
                   ignore_eos=True)
    [choice] = out["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + max_tokens
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None  # no context: null
    expected = [reference[i - 1, ids[i]] for i in range(1, len(ids))]
    assert logprobs["token_logprobs"][1:len(ids)] == pytest.approx(expected, abs=TOLERANCE)
    for i in range(1, len(ids)):  # the top of the distribution before each prompt token (keyed by text: byte
        top = logprobs["top_logprobs"][i]  # tokens that decode alike share a key)
        best = np.sort(reference[i - 1])[::-1][:3]
        assert all(np.abs(best - value).min() < TOLERANCE for value in top.values())
    assert logprobs["text_offset"][0] == 0 and choice["text"] == "".join(logprobs["tokens"])
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": max_tokens,
                            "total_tokens": len(ids) + max_tokens}
    assert choice["finish_reason"] == "length"
    if max_tokens:  # the generated tokens' logprobs follow, from the same distribution as the prompt's
        assert all(lp <= 0 for lp in logprobs["token_logprobs"][len(ids):])


def test_a_streamed_echo_carries_the_prompt_logprobs(api_server):
    ids, reference = hf_logprobs()
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 2, "echo": True, "logprobs": 1, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    with httpx.stream("POST", f"{api_server.url}/v1/completions", json=body, timeout=TIMEOUT_S) as response:
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    first = json.loads(lines[0])["choices"][0]
    logprobs = first["logprobs"]
    assert first["text"] == "".join(logprobs["tokens"]) and logprobs["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx([reference[i - 1, ids[i]] for i in range(1, len(ids))],
                                                           abs=TOLERANCE)
    refused = httpx.post(f"{api_server.url}/v1/completions", json={**body, "max_tokens": 0}, timeout=TIMEOUT_S)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"


def test_lm_eval_harness_loglikelihood_request(api_server):
    # lm-eval's local-completions model: token-id prompts in a batch, max_tokens 1, logprobs 1, echo, seed
    contexts = [[5, 17, 40], [99, 123]]
    continuations = [[7, 250], [8]]
    body = {"model": MODEL_NAME, "prompt": [c + k for c, k in zip(contexts, continuations, strict=True)],
            "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    choices = complete(api_server.url, **body)["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice, context, continuation in zip(choices, contexts, continuations, strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(context) + len(continuation) + 1  # + the generated token
        picked = logprobs["token_logprobs"][len(context):-1]
        assert len(picked) == len(continuation) and all(math.isfinite(lp) and lp <= 0 for lp in picked)
        for top in logprobs["top_logprobs"][len(context):-1]:
            assert len(top) == 1  # what lm-eval reads to decide is_greedy


def test_a_long_prompt_is_scored_in_one_engine_request_as_teacher_forcing_scores_it(tmp_path_factory):
    engine = make_engine(model_folder(tmp_path_factory.mktemp("models")))  # prefill chunks of <= 64 tokens
    ids = np.random.default_rng(2).integers(3, 320, 150).tolist()
    # teacher forcing, one request per position: prompt ids[:i], ids[i] forced by a +100 bias (sampled from the
    # biased distribution, logprobs from the raw one)
    positions = [1, 2, 63, 64, 65, 100, 128, 149]
    forced = {i: engine.generate([ids[:i]], SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, logit_bias=(
        (ids[i], MAX_LOGIT_BIAS),)))[0].outputs[0] for i in positions}
    assert all(forced[i].token_ids == [ids[i]] for i in positions)
    added = []
    add_request = engine.add_request
    engine.add_request = lambda prompt, *args: added.append(len(prompt)) or add_request(prompt, *args)
    with running_server(engine) as (server, _):
        out = complete(server.url, prompt=ids, max_tokens=0, echo=True, logprobs=2)
        assert added == [len(ids)]  # one request, not one per position
        logprobs = out["choices"][0]["logprobs"]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        for i in positions:
            assert logprobs["token_logprobs"][i] == pytest.approx(forced[i].logprobs[0]["logprob"], abs=TOLERANCE)
            top = np.array([lp for _, lp in forced[i].logprobs[0]["top"]])  # keyed by text: alike tokens share a key
            assert all(np.abs(top - value).min() < TOLERANCE for value in logprobs["top_logprobs"][i].values())
        # lm-eval's local-completions loglikelihood batch (token ids and text): one request per prompt, scored and
        # generating one token
        added.clear()
        body = {"prompt": [ids, ids[:70]], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
                "echo": True}
        choices = complete(server.url, **body)["choices"]
        assert sorted(added) == [70, len(ids)]
        for choice, prompt in zip(choices, [ids, ids[:70]], strict=True):
            scored = choice["logprobs"]["token_logprobs"]
            assert len(scored) == len(prompt) + 1 and scored[:len(prompt)] == pytest.approx(
                logprobs["token_logprobs"][:len(prompt)], abs=TOLERANCE)
            is_greedy = all(lp >= max(top.values()) - TOLERANCE for lp, top in  # as lm-eval decides it
                            zip(scored[1:-1], choice["logprobs"]["top_logprobs"][1:-1], strict=True))
            assert not is_greedy  # random ids are not the model's greedy continuation
        text = ["The quick brown fox", "jumps over the lazy dog"]
        texts = complete(server.url, **{**body, "prompt": text, "max_tokens": 0})["choices"]
        assert [c["text"] for c in texts] == text
        assert all(c["logprobs"]["token_logprobs"][0] is None and len(c["logprobs"]["tokens"]) == len(t)
                   for c, t in zip(texts, text, strict=True))  # the fixture's tokenizer: one token per character


def test_a_list_of_prompts_gets_one_choice_per_prompt_and_sample(api_server):
    prompts = ["a", "bc", "def"]
    out = complete(api_server.url, prompt=prompts, max_tokens=3, n=2, temperature=1.0, seed=3, ignore_eos=True)
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 6 * 3 and out["usage"]["prompt_tokens"] == 1 + 2 + 3
    alone = complete(api_server.url, prompt="bc", max_tokens=3, n=2, temperature=1.0, seed=3, ignore_eos=True)
    assert [c["text"] for c in out["choices"][2:4]] == [c["text"] for c in alone["choices"]]  # seeded per prompt
    echoed = complete(api_server.url, prompt=["ab", "cd"], max_tokens=0, echo=True)["choices"]
    assert [c["text"] for c in echoed] == ["ab", "cd"] and all(c["logprobs"] is None for c in echoed)


def test_logit_bias_moves_the_sampler(api_server, oai):
    ids, reference = hf_logprobs()
    prompt, before = ids[:3], reference[2]  # the distribution after the prompt
    ranked = np.argsort(before)[::-1]

    def chosen(**fields) -> float:
        """The logprob (under the unbiased model) of the token the request took."""
        out = complete(api_server.url, prompt=prompt, max_tokens=1, logprobs=0, ignore_eos=True, **fields)
        return out["choices"][0]["logprobs"]["token_logprobs"][0]

    assert chosen(temperature=0.0) == pytest.approx(before[ranked[0]], abs=TOLERANCE)
    # -100 bans the greedy token: greedy takes the runner-up
    assert chosen(temperature=0.0, logit_bias={str(ranked[0]): -100}) == pytest.approx(before[ranked[1]],
                                                                                        abs=TOLERANCE)
    # +100 forces an unlikely token, on greedy and sampled rows alike
    unlikely = int(ranked[-1])
    for fields in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 5}, {"temperature": 2.0, "top_p": 0.5}):
        assert chosen(logit_bias={str(unlikely): 100}, **fields) == pytest.approx(before[unlikely], abs=TOLERANCE)
    # through the official client, chat and completions, batched with a request without a bias
    reply = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0.0, logprobs=0,
                                   logit_bias={str(unlikely): 100})
    assert reply.choices[0].logprobs.token_logprobs[0] == pytest.approx(before[unlikely], abs=TOLERANCE)
    chat = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0.0, logit_bias={"77": 100}, logprobs=True,
                                       extra_body={"ignore_eos": True})
    assert len({t.token for t in chat.choices[0].logprobs.content}) == 1


def test_tokens_that_come_together_stream_as_one_chunk_with_every_logprob(tmp_path):
    """A multi-step decode (4 tokens per device call) hands the front end 4 tokens of a sequence at once, and
    more wait when the engine thread runs ahead of the event loop: those waiting stream as one chunk (text and
    logprobs of each), and the chunks add up to the non-streamed answer."""
    engine = make_engine(model_folder(tmp_path), decode_steps=4)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 13, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 2}
    with running_server(engine) as (server, _):
        whole = complete(server.url, **body)["choices"][0]
        streamed = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT_S).text
    chunks = [json.loads(line.removeprefix("data: ")) for line in streamed.split("\n\n")
              if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks]
    sizes = [len(c["logprobs"]["tokens"]) for c in choices]
    assert sum(sizes) == 13 and max(sizes) >= 4 and len(choices) < 13
    assert "".join(c["text"] for c in choices) == whole["text"]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in choices for x in c["logprobs"][field]] == whole["logprobs"][field], field
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
