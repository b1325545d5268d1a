"""The dashboard (``/dashboard`` and ``/dashboard/stats``) on real loopback servers: the stats JSON over httpx
(shape, counts after a request, the API key), and the page in headless Chromium driven by Selenium (it loads,
its graphs follow the stats, its chat box streams the same answer the API gives, it asks for the key).

Two servers: the tiny Qwen3-MoE fixture with n-gram speculation (experts and drafts to count), and the dense
Llama fixture with an API key (it runs no request)."""

import dataclasses
import shutil

import httpx
import pytest
from helpers.server import LLAMA, make_engine, model_folder, running_server, write_tokenizer
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from serving.api.dashboard import WINDOW_S, TokenRate
from serving.api.server import Server, create_app
from serving.engine.kv_tiers import TierStats
from serving.spec_decode import NgramDrafter, SpecConfig

KEY = "sk-dashboard-0123456789"
MOE_NAME = "tiny-qwen3-moe"
MAX_TOKENS = 12
PROMPT_TOKENS = 40  # the chat prompt's length bucket (64 tokens): the two requests share one compile
TIMEOUT_S = 60
WAIT_S = 10  # for the page: a few 1 s polls
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
STATS_KEYS = {"model", "uptime_s", "running", "waiting", "in_flight", "generated_tokens", "prompt_tokens",
              "tokens_per_s", "window_s", "kv_blocks_used", "kv_blocks_total", "kv_block_size", "expert_tokens",
              "acceptance_rate", "mean_acceptance_length", "cache_tiers", "requests", "errors", "overloaded", "ttft_ms",
              "tpot_ms"}
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="Chromium is not installed: the browser tests need Debian's `apt-get install chromium chromium-driver`")


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / MOE_NAME
    shutil.copytree(LLAMA.parent / "qwen3_moe", folder)
    write_tokenizer(folder)
    engine = make_engine(folder, speculative=SpecConfig(NgramDrafter(), k=3), host_cache_blocks=64)
    with Server(create_app(engine, MOE_NAME)) as server:
        yield server


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    with running_server(make_engine(model_folder(tmp_path_factory.mktemp("models"))), api_key=KEY) as (server, _):
        yield server


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


def engine_of(server: Server):
    return server.server.config.app.state.frontend.engine


def stats(server: Server, **headers: str) -> dict:
    response = httpx.get(f"{server.url}/dashboard/stats", headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def wait(driver, condition, timeout: float = WAIT_S):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: condition())


def text(driver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).get_property("textContent")


def test_token_rate_is_a_sliding_window():
    rate = TokenRate(10.0, start=0.0)
    assert rate.update(1.0, 50) == 50.0
    assert rate.update(5.0, 100) == 20.0  # from the start sample: none is 10 s old yet
    assert rate.update(12.0, 100) == pytest.approx(50 / 11)  # from (1, 50), the newest sample at least 10 s old
    assert rate.update(30.0, 100) == 0.0  # nothing generated in the last 18 s
    assert len(rate.samples) == 2
    with pytest.raises(ValueError, match="window_s=0"):
        TokenRate(0.0, start=0.0)


def test_stats_count_a_request_its_expert_tokens_and_drafts(moe_server):
    engine = engine_of(moe_server)
    cfg, spec = engine.cfg, engine.spec_stats
    before = stats(moe_server)
    assert set(before) == STATS_KEYS and before["model"] == MOE_NAME and before["window_s"] == WINDOW_S
    assert before["kv_blocks_total"] == 512 and before["kv_block_size"] == 4
    drafts, accepted = spec.num_draft_tokens, spec.num_accepted_tokens
    prompt = list(range(3, 3 + PROMPT_TOKENS))
    body = {"model": MOE_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    usage = httpx.post(f"{moe_server.url}/v1/completions", json=body, timeout=TIMEOUT_S).json()["usage"]
    after = stats(moe_server)
    assert after["generated_tokens"] - before["generated_tokens"] == MAX_TOKENS == usage["completion_tokens"]
    assert after["requests"] == before["requests"] + 1 and after["errors"] == before["errors"]
    assert set(after["ttft_ms"]) == {"p50", "p90", "p99"} and 0 < after["ttft_ms"]["p50"] <= after["ttft_ms"]["p99"]
    assert 0 < after["tpot_ms"]["p50"] <= after["tpot_ms"]["p90"] <= after["tpot_ms"]["p99"]
    assert httpx.post(f"{moe_server.url}/v1/completions", json={}).status_code == 400
    assert stats(moe_server)["errors"] == after["errors"] + 1
    assert after["prompt_tokens"] - before["prompt_tokens"] == PROMPT_TOKENS
    assert after["tokens_per_s"] > 0 and after["uptime_s"] > before["uptime_s"]
    assert after["running"] == after["waiting"] == after["in_flight"] == 0
    drafts, accepted = spec.num_draft_tokens - drafts, spec.num_accepted_tokens - accepted
    assert drafts > 0  # the n-gram drafter proposed something in 12 greedy tokens
    assert after["acceptance_rate"] == spec.acceptance_rate and 0 <= after["acceptance_rate"] <= 1
    assert after["mean_acceptance_length"] == spec.mean_acceptance_length >= 1
    # the same prompt again: its full blocks come from the prefix cache (GPU tier), counted in the tier stats
    httpx.post(f"{moe_server.url}/v1/completions", json=body, timeout=TIMEOUT_S).raise_for_status()
    tiers = stats(moe_server)["cache_tiers"]
    assert set(tiers) == {f.name for f in dataclasses.fields(TierStats)}
    assert tiers["gpu_hits"] - after["cache_tiers"]["gpu_hits"] == (PROMPT_TOKENS - 1) // engine.allocator.block_size
    experts = after["expert_tokens"]
    assert len(experts) == cfg.layers and all(len(row) == cfg.num_experts for row in experts)
    # every token the model ran goes to top_k experts in each MoE layer: the prompt, each generated token but the
    # last, and the drafts it rejected (accepted ones are generated tokens)
    moe_layers = sum(cfg.is_moe_layer(l) for l in range(cfg.layers))
    routed = sum(map(sum, experts)) - sum(map(sum, before["expert_tokens"]))
    assert routed == (PROMPT_TOKENS + MAX_TOKENS - 1 + drafts - accepted) * cfg.top_k * moe_layers


def test_page_is_open_but_stats_need_the_key(keyed_server):
    url = keyed_server.url
    page = httpx.get(f"{url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<title>serving dashboard</title>" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]  # nothing loads from elsewhere
    refused = httpx.get(f"{url}/dashboard/stats")
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/dashboard/stats", headers={"Authorization": f"Bearer {KEY}x"}).status_code == 401
    assert stats(keyed_server, **{"x-api-key": KEY})["model"] == "tiny-llama"
    dense = stats(keyed_server, authorization=f"Bearer {KEY}")
    assert set(dense) == STATS_KEYS and dense["expert_tokens"] == []
    assert dense["ttft_ms"] is None and dense["tpot_ms"] is None  # no request ran
    assert dense["acceptance_rate"] is None and dense["mean_acceptance_length"] is None
    assert dense["cache_tiers"] is None


@needs_chromium
def test_page_loads_streams_a_chat_and_its_graphs_follow(moe_server, browser):
    prompt = "What is the load?"
    body = {"model": MOE_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0.0}
    reference = httpx.post(f"{moe_server.url}/v1/chat/completions", json=body, timeout=TIMEOUT_S).json()
    answer, generated = reference["choices"][0]["message"]["content"], reference["usage"]["completion_tokens"]

    browser.get(f"{moe_server.url}/dashboard")
    assert browser.title == "serving dashboard"
    wait(browser, lambda: int(browser.find_element(By.TAG_NAME, "body").get_attribute("data-polls")) >= 1)
    assert text(browser, "model") == MOE_NAME and text(browser, "status") == "live"
    assert not browser.find_element(By.ID, "key-form").is_displayed()
    assert text(browser, "experts-summary").startswith("2 layers x 8 experts")
    assert text(browser, "acceptance").startswith("acceptance ")
    assert text(browser, "cache-tiers").startswith("prefix hits: GPU ")
    tokens_canvas, experts_canvas = (browser.find_element(By.ID, i) for i in ("tokens-canvas", "experts-canvas"))
    before_total = int(text(browser, "generated"))
    before_points, before_experts = int(tokens_canvas.get_attribute("data-points")), \
        int(experts_canvas.get_attribute("data-total"))

    for element_id, value in (("temperature", "0"), ("max-tokens", str(MAX_TOKENS)), ("prompt", prompt)):
        field = browser.find_element(By.ID, element_id)
        field.clear()
        field.send_keys(value)
    browser.find_element(By.ID, "send").click()
    reply = wait(browser, lambda: browser.find_element(By.CSS_SELECTOR, ".msg.assistant[data-state=done]"),
                 TIMEOUT_S)
    assert reply.get_property("textContent") == answer
    assert reply.get_attribute("data-finish-reason") == reference["choices"][0]["finish_reason"]
    assert [m.get_property("textContent") for m in browser.find_elements(By.CSS_SELECTOR, ".msg.user")] == [prompt]

    # the next polls show the request: its tokens in the totals, the rate, the expert heat map
    wait(browser, lambda: int(text(browser, "generated")) == before_total + generated)
    wait(browser, lambda: int(tokens_canvas.get_attribute("data-points")) > before_points)
    assert float(text(browser, "tokens-per-s")) > 0
    assert float(tokens_canvas.get_attribute("data-last").strip("[]")) > 0
    assert int(experts_canvas.get_attribute("data-total")) > before_experts
    # request counts and latency percentiles, and every graph has a time axis
    wait(browser, lambda: int(text(browser, "requests")) >= 2 and text(browser, "ttft-p50") != "-")
    assert float(text(browser, "ttft-p50")) <= float(text(browser, "ttft-p99"))
    assert float(text(browser, "tpot-p50")) <= float(text(browser, "tpot-p99"))
    latency = browser.find_element(By.ID, "latency-canvas")
    assert float(latency.get_attribute("data-last").strip("[]").split(",")[0]) > 0
    for canvas_id in ("requests-canvas", "tokens-canvas", "kv-canvas", "latency-canvas"):
        canvas = browser.find_element(By.ID, canvas_id)
        assert canvas.get_attribute("data-xlabels") == '["now","-30s","-60s","-90s","-120s"]'


@needs_chromium
def test_chat_box_shows_the_error_of_a_refused_request(moe_server, browser):
    browser.get(f"{moe_server.url}/dashboard")
    wait(browser, lambda: int(browser.find_element(By.TAG_NAME, "body").get_attribute("data-polls")) >= 1)
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("100000")
    browser.find_element(By.ID, "prompt").send_keys("hi")
    browser.find_element(By.ID, "send").click()
    reply = wait(browser, lambda: browser.find_element(By.CSS_SELECTOR, ".msg.assistant[data-state=error]"))
    assert "HTTP 400: max_tokens=100000" in reply.get_property("textContent")
    wait(browser, lambda: int(text(browser, "errors")) >= 1)  # the refusal shows in the error count


@needs_chromium
def test_page_asks_for_the_key(keyed_server, browser):
    browser.get(f"{keyed_server.url}/dashboard")
    key_form = browser.find_element(By.ID, "key-form")
    wait(browser, key_form.is_displayed)
    assert text(browser, "status") == "this server needs its API key"
    browser.find_element(By.ID, "api-key").send_keys(KEY)
    key_form.find_element(By.TAG_NAME, "button").click()
    wait(browser, lambda: text(browser, "status") == "live")
    assert not key_form.is_displayed()
    assert text(browser, "model") == "tiny-llama"
    assert text(browser, "experts-summary") == "dense model: no experts"
    assert not browser.find_element(By.ID, "experts-canvas").is_displayed()
    assert text(browser, "acceptance") == "off"
    assert text(browser, "cache-tiers") == "prefix cache on the GPU only"
