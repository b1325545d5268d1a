"""One short run of each part through its public entry point, as a user calls it.

On a GPU (``make gpu-check``) these run the compiled Pallas kernels: the fused AdamW step against a float64
NumPy AdamW, one fused PC epoch against XLA's settling loop, the engine's greedy tokens on every HF fixture
against HF's, and the HTTP server answering a request. On a CPU the same tests run the kernels in interpret
mode (AdamW, PC) and the engine's default path, so the checks themselves never rot.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.hf import HF, reference
from helpers.server import make_engine, model_folder, running_server

import pc
from apex_jax import ApexW, flatten
from pallas_kernels.testing import on_gpu
from serving import Engine, SamplingParams

# An odd-shaped pytree: leaves not multiples of any tile, one below the int8 kind's fp32 threshold (4096).
SHAPES = {"bias": (3,), "proj": (17, 5), "embed": (1000, 33), "conv": (2, 3, 7), "table": (4100,)}
STEPS = 5
LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.999, 1e-8, 0.1
# max |p - p64| / max |p64| after STEPS steps: fp32 moments carry fp32 rounding only; bf16 and int8 moments
# round every step (test_apexw.test_compact_kinds_track_fp32 bounds 30 steps the same way).
ADAMW_BOUND = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.int8: 5e-2, jnp.int4: 3e-2}
FUSED = "pallas" if on_gpu() else "pallas_interpret"  # the Pallas kernels, compiled where there is a GPU


def adamw_float64(params: dict, grads: list[dict]) -> dict:
    """Decoupled AdamW (optax.adamw's rule) in float64 NumPy, one step per gradient."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, g in enumerate(grads, start=1):
        for k in p:
            gk = np.asarray(g[k], np.float64)
            m[k] = B1 * m[k] + (1 - B1) * gk
            v[k] = B2 * v[k] + (1 - B2) * gk * gk
            m_hat, v_hat = m[k] / (1 - B1**t), v[k] / (1 - B2**t)
            p[k] = p[k] - LR * (m_hat / (np.sqrt(v_hat) + EPS) + WD * p[k])
    return p


@pytest.mark.parametrize("state_dtype", list(ADAMW_BOUND), ids=lambda dtype: jnp.dtype(dtype).name)
def test_fused_adamw_step_matches_float64_adamw(state_dtype):
    keys = jax.random.split(jax.random.key(0), 2 * len(SHAPES) * STEPS + len(SHAPES))
    params = {k: jax.random.normal(keys[i], s) for i, (k, s) in enumerate(SHAPES.items())}
    grads = [{k: 0.1 * jax.random.normal(keys[len(SHAPES) * (1 + t) + i], s) for i, (k, s) in enumerate(SHAPES.items())}
             for t in range(STEPS)]
    opt = ApexW(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, state_dtype=state_dtype, implementation=FUSED)
    expected = adamw_float64(params, grads)
    flat = flatten(params)
    state = opt.init(flat)
    step = jax.jit(opt.step, donate_argnums=(0, 2))
    for g in grads:
        flat, state = step(flat, flatten(g), state)
    got = flat.tree()
    worst = max(float(np.max(np.abs(np.asarray(got[k], np.float64) - expected[k])) / np.max(np.abs(expected[k])))
                for k in SHAPES)
    assert worst <= ADAMW_BOUND[state_dtype], f"{jnp.dtype(state_dtype).name}: {worst:.3g}"


# Relative difference of the weight updates, fused kernel vs XLA's loop: both sum their matmuls in different
# orders, and T settling steps carry the differences on. tf32 rounds the operands to 10 mantissa bits (~5e-4
# relative a product), which kernel and loop apply to different partial results.
PC_UPDATE_BOUND = {"float32": 1e-3, "tf32": 1e-2}


@pytest.mark.parametrize("precision", list(PC_UPDATE_BOUND))
def test_fused_pc_epoch_matches_the_xla_loop(precision):
    """One epoch of supervised PC training through the fused settle kernel and through XLA's loop: the same
    weight updates (up to summation order), accuracy and energy. The GPU runs a Deepity-sized net."""
    sizes, rows, batch, T = ((784, 512, 512, 10), 1000, 250, 20) if on_gpu() else ((784, 24, 16, 10), 100, 25, 5)
    net = pc.PCNet(sizes, activation="sigmoid", output="cross_entropy", input_activation=False, precision=precision)
    images = jax.random.uniform(jax.random.key(1), (rows, sizes[0]))
    labels = jax.random.randint(jax.random.key(2), (rows,), 0, sizes[-1])
    params = pc.init_params(jax.random.key(0), net)
    tx = optax.sgd(0.1)
    run = lambda implementation: pc.train_epoch(params, tx.init(params), tx, images, labels, net=net, T=T, dt=0.1,
                                                batch_size=batch, key=jax.random.key(3), implementation=implementation)
    (fused, _, fused_metrics), (loop, _, loop_metrics) = run(FUSED), run("xla")
    for l, (a, b, p0) in enumerate(zip(fused, loop, params, strict=True)):
        for name in ("w", "b"):
            step = np.asarray(b[name] - p0[name])
            assert np.linalg.norm(step) > 1e-6, f"params[{l}][{name!r}] did not train"
            err = np.linalg.norm(np.asarray(a[name] - p0[name]) - step) / np.linalg.norm(step)
            assert err < PC_UPDATE_BOUND[precision], f"params[{l}][{name!r}] update differs by {err:.3g}"
    for name in ("energy", "accuracy", "diverged"):
        np.testing.assert_allclose(fused_metrics[name], loop_metrics[name], rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss",
                                  *(pytest.param(n, marks=pytest.mark.slow) for n in ("qwen3", "mixtral_window"))])
def test_engine_greedy_tokens_match_hf(name):
    prompts, greedy = reference(name)
    engine = Engine(HF / name, dtype=jnp.float32, num_blocks=64, block_size=4, max_running=8, token_budget=64)
    params = SamplingParams(temperature=0.0, max_tokens=greedy.shape[1], ignore_eos=True)
    assert [r.outputs[0].token_ids for r in engine.generate(prompts, params)] == greedy.tolist()


def test_server_answers_a_chat_request(tmp_path):
    import httpx

    with running_server(make_engine(model_folder(tmp_path))) as (server, _):
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": "tiny-llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
            "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["finish_reason"] == "length"
    assert isinstance(body["choices"][0]["message"]["content"], str)
