"""Block drafter: the model (shapes, masking, checkpoint), its serving (one pass per proposal, the hidden-state
ring buffer), the engine with it (greedy identical to plain decoding in a batch, seeded sampling distributed as
the target's, structured output), and a tiny training run (tiny Llama fixture)."""

import dataclasses
import functools
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import HF
from helpers.server import model_folder
from scipy import stats

from examples.train_drafter.prompts import chat_prompts
from examples.train_drafter.train import (
    FINAL_LR_SHARE,
    TrainConfig,
    answers,
    evaluate_offline,
    gather,
    lr_at,
    target_data,
    train,
    truncate_context,
)
from serving import ConstraintSpec, Engine, SamplingParams
from serving.__main__ import parser
from serving.api import cli as api_cli
from serving.config import ModelConfig
from serving.engine.sampler import SampleRow, sampling_batch
from serving.loaders import load_params
from serving.spec_decode import (
    BlockDrafter,
    DraftRequest,
    HiddenSpan,
    HiddenStateDrafter,
    SpecConfig,
    block_model,
    verify,
)
from serving.spec_decode.block_model import BlockDrafterConfig

BLOCK = 4  # KV cache block of the engines
K = 4  # draft tokens per pass
WINDOW = 8
TRAIN = TrainConfig(block=K, window=WINDOW, layers=1, steps=150, batch=32, lr=3e-3, warmup=10, decay=0.8)
SEEDS = 400  # sampled requests per distribution test
P_VALUE = 1e-3  # a correct sampler fails once in a thousand (the seeds are fixed)


@functools.cache
def target() -> tuple[ModelConfig, dict]:
    return load_params(HF / "llama", jnp.float32)


@functools.cache
def reference() -> tuple[list[list[int]], list[list[int]]]:
    with np.load(HF / "llama" / "reference.npz") as ref:
        prompts = [ids[:n].tolist() for ids, n in zip(ref["input_ids"], ref["lengths"], strict=True)]
        return prompts, ref["greedy"].tolist()


def drafter_config(**kwargs) -> BlockDrafterConfig:
    return BlockDrafterConfig.for_target(target()[0], **({"block": K, "window": WINDOW, "layers": 1} | kwargs))


@functools.cache
def trained() -> tuple[dict, list[dict], dict, dict]:
    """A drafter trained briefly on the fixture's greedy outputs: (params, curve, acceptance before, after)."""
    cfg, params = target()
    prompts, greedy = reference()
    dcfg, head = drafter_config(), block_model.target_head(params)
    data = target_data(cfg, params, list(zip(prompts, greedy, strict=True)), dcfg.target_layers, 64, jnp.float32)
    initial = block_model.init_params(dcfg, cfg, jax.random.key(TRAIN.seed), params)  # the target's top layer
    before = evaluate_offline(initial, head, dcfg, cfg, data, TRAIN.decay, TRAIN.batch)
    drafter_params, curve = train(TRAIN, dcfg, cfg, head, initial, data, seconds=600, log=lambda *_: None)
    after = evaluate_offline(drafter_params, head, dcfg, cfg, data, TRAIN.decay, TRAIN.batch)
    return drafter_params, curve, before, after


def spec(params: dict | None = None, sample: bool = False) -> SpecConfig:
    dcfg = drafter_config()
    params = block_model.init_params(dcfg, target()[0], jax.random.key(1)) if params is None else params
    return SpecConfig(lambda cfg, target_params: BlockDrafter(dcfg, params, cfg, target_params, max_seqs=64,
                                                              sample=sample), k=K)


def engine(speculative: SpecConfig | None, model: Path = HF / "llama", **kwargs) -> Engine:
    options = dict(dtype=jnp.float32, num_blocks=256, block_size=BLOCK, max_running=8, token_budget=64) | kwargs
    return Engine(model, speculative=speculative, **options)


def tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


# --------------------------------------------------------------------------- the model


def test_forward_shapes_and_context_masking():
    cfg, params = target()
    dcfg = drafter_config()
    dparams = block_model.init_params(dcfg, cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = 3
    hidden = rng.normal(size=(batch, WINDOW, len(dcfg.target_layers), cfg.hidden)).astype(np.float32)
    newest = rng.integers(0, cfg.vocab, batch).astype(np.int32)
    positions = np.broadcast_to(np.arange(-WINDOW, 0), (batch, WINDOW)).astype(np.int32)
    valid = np.ones((batch, WINDOW), bool)
    valid[0, :5] = False  # the first sequence's context starts 3 positions back
    run = jax.jit(block_model.draft_logits, static_argnames=("cfg", "target"))
    head = block_model.target_head(params)
    logits = np.asarray(run(dparams, head, dcfg, cfg, hidden, newest, positions, valid))
    assert logits.shape == (batch, K, cfg.vocab) and np.isfinite(logits).all()
    masked_changed = hidden.copy()
    masked_changed[0, :5] += 10.0
    assert np.allclose(run(dparams, head, dcfg, cfg, masked_changed, newest, positions, valid), logits, atol=1e-5)
    valid_changed = hidden.copy()
    valid_changed[0, 6] += 1.0
    changed = np.asarray(run(dparams, head, dcfg, cfg, valid_changed, newest, positions, valid))
    assert not np.allclose(changed[0], logits[0], atol=1e-4) and np.allclose(changed[1:], logits[1:])


def test_checkpoint_round_trips(tmp_path):
    cfg, _ = target()
    dcfg = drafter_config(block=6)
    params = block_model.init_params(dcfg, cfg, jax.random.key(2))
    folder = block_model.save(tmp_path / "drafter", dcfg, params)
    loaded_cfg, loaded = block_model.load(folder, cfg)
    assert loaded_cfg == dcfg
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True))


def test_bad_checkpoints_and_configs_raise_clear_errors(tmp_path):
    cfg, params = target()
    dcfg = drafter_config()
    with pytest.raises(ValueError, match=r"BlockDrafterConfig.block = 0: expected an int >= 1"):
        drafter_config(block=0)
    with pytest.raises(FileNotFoundError, match="no drafter_config.json"):
        block_model.load(tmp_path, cfg)
    folder = block_model.save(tmp_path / "ok", dcfg, block_model.init_params(dcfg, cfg, jax.random.key(0)))
    other = dataclasses.replace(cfg, hidden=cfg.hidden * 2)
    with pytest.raises(ValueError, match=re.escape(f"(hidden, vocab, layers) = ({cfg.hidden}, {cfg.vocab}, "
                                                   f"{cfg.layers}): the target has ({2 * cfg.hidden}, ")):
        block_model.load(folder, other)
    config = json.loads((folder / block_model.CONFIG_FILE).read_text())
    (folder / block_model.CONFIG_FILE).write_text(json.dumps(config | {"depth": 3}))
    with pytest.raises(ValueError, match=r"unknown keys \['depth'\]"):
        block_model.load(folder, cfg)
    (folder / block_model.CONFIG_FILE).write_text(json.dumps(config | {"window": 2 * WINDOW}))
    block_model.load_config(folder)  # a consistent config; the weights do not fit it:
    (folder / block_model.CONFIG_FILE).write_text(json.dumps(config | {"block": K + 2}))
    with pytest.raises(ValueError, match=rf"shape \[{K}, {cfg.hidden}\] 'slots', expected shape \[{K + 2}, "):
        block_model.load(folder, cfg)
    (folder / block_model.CONFIG_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        block_model.load(folder, cfg)
    with pytest.raises(ValueError, match=r"BlockDrafterConfig.layers = 2: expected fewer than the target's 2"):
        drafter_config(layers=2)
    with pytest.raises(ValueError, match="speculative method 'medusa': expected one of"):
        SpecConfig.from_method("medusa")
    with pytest.raises(ValueError, match="speculative method 'block' needs a drafter checkpoint"):
        SpecConfig.from_method("block")
    with pytest.raises(FileNotFoundError, match="no drafter_config.json"):
        SpecConfig.from_method("block", tmp_path)
    moe = ModelConfig.from_hf(json.loads((HF / "qwen3_moe" / "config.json").read_text()))
    with pytest.raises(ValueError, match="family 'qwen3_moe'.s forward has no hidden_layers"):
        BlockDrafter(BlockDrafterConfig.for_target(moe, layers=1), {}, moe, params)


# --------------------------------------------------------------------------- serving


def test_one_block_proposal_per_sequence_in_one_pass():
    cfg, params = target()
    dcfg = drafter_config()
    dparams = block_model.init_params(dcfg, cfg, jax.random.key(3))
    drafter = BlockDrafter(dcfg, dparams, cfg, params, max_seqs=4)
    assert isinstance(drafter, HiddenStateDrafter)
    rng = np.random.default_rng(1)
    lengths = {7: 12, 8: 5, 9: 20}  # seq id -> positions with hidden states (prompt + accepted tokens)
    states = {s: rng.normal(size=(n, len(dcfg.target_layers), cfg.hidden)).astype(np.float32)
              for s, n in lengths.items()}
    for part in (slice(0, -3), slice(-3, None)):  # two verification passes: all but the last 3 positions, then those
        rows = [states[s][part] for s in lengths]
        firsts = np.cumsum([0] + [len(r) for r in rows])
        drafter.observe(jnp.asarray(np.concatenate(rows)),
                        [HiddenSpan(s, int(f), range(n)[part][0], len(r))
                         for (s, n), f, r in zip(lengths.items(), firsts, rows, strict=False)])
    seqs = {s: rng.integers(0, cfg.vocab, n + 1).tolist() for s, n in lengths.items()}  # + the newest token
    greedy = SamplingParams(temperature=0.0)
    requests = [DraftRequest(7, seqs[7], 3, greedy, 0, K), DraftRequest(8, seqs[8], 1, greedy, 0, 2),
                DraftRequest(9, seqs[9], 5, greedy, 0, 0), DraftRequest(10, [1, 2, 3], 1, greedy, 0, K),
                DraftRequest(9, seqs[9] + [4], 6, greedy, 0, K)]  # 9 + [4] and 10: hidden states not observed
    proposal = drafter.propose(requests, K)
    assert drafter.num_passes == 1 and proposal.probs is None
    assert [len(d) for d in proposal.tokens] == [K, 2, 0, 0, 0]
    for i, seq_id in enumerate((7, 8)):  # the same drafts from the model, given the last WINDOW states in order
        n = lengths[seq_id]
        t = np.arange(n - WINDOW, n)  # context positions; the newest token is at n
        ctx = np.where((t >= 0)[:, None, None], states[seq_id][np.maximum(t, 0)], 0)
        logits = block_model.draft_logits(dparams, block_model.target_head(params), dcfg, cfg, ctx[None],
                                            np.array([seqs[seq_id][n]]), (t - n)[None], (t >= 0)[None])
        assert proposal.tokens[i] == np.asarray(jnp.argmax(logits[0], -1))[:len(proposal.tokens[i])].tolist()
    drafter.release(7)
    assert drafter.propose(requests[:1], K).tokens == [[]]


def test_slots_reuse_the_least_recently_observed_and_grow_for_a_larger_pass():
    cfg, params = target()
    dcfg = drafter_config()
    drafter = BlockDrafter(dcfg, block_model.init_params(dcfg, cfg, jax.random.key(6)), cfg, params, max_seqs=2)
    hidden = jnp.ones((4, len(dcfg.target_layers), cfg.hidden))
    drafter.observe(hidden, [HiddenSpan(s, s, 0, 1) for s in range(3)])  # 3 sequences in one pass, 2 slots
    assert drafter.ring.features.shape[0] == 4 and list(drafter.slots) == [0, 1, 2]
    drafter.observe(hidden, [HiddenSpan(3, 0, 0, 1)])  # the fourth slot
    drafter.observe(hidden, [HiddenSpan(4, 0, 0, 1)])  # none free: sequence 0's is reused
    assert list(drafter.slots) == [1, 2, 3, 4] and 0 not in drafter.observed
    assert drafter.slots[4] not in [drafter.slots[s] for s in (1, 2, 3)]
    greedy = SamplingParams(temperature=0.0)
    proposal = drafter.propose([DraftRequest(4, [5, 6], 1, greedy, 0, K), DraftRequest(0, [5, 6], 1, greedy, 0, K)], K)
    assert [len(d) for d in proposal.tokens] == [K, 0]


def test_sampling_drafter_returns_its_distribution_per_request_row():
    cfg, params = target()
    dcfg = drafter_config()
    drafter = BlockDrafter(dcfg, block_model.init_params(dcfg, cfg, jax.random.key(4)), cfg, params, sample=True)
    drafter.observe(jnp.ones((8, len(dcfg.target_layers), cfg.hidden)), [HiddenSpan(0, 0, 0, 6)])
    sampled = SamplingParams(temperature=1.0, top_k=5)
    requests = [DraftRequest(5, [1, 2], 1, sampled, 0, K), DraftRequest(0, list(range(7)), 1, sampled, 3, K - 1)]
    proposal = drafter.propose(requests, K)
    assert proposal.tokens[0] == [] and len(proposal.tokens[1]) == K - 1
    q = np.asarray(proposal.probs)
    assert q.shape == (2, K, cfg.vocab) and np.allclose(q[1].sum(-1), 1, atol=1e-5)
    assert ((q[1] > 0).sum(-1) <= 5).all()  # top-k 5 filtered
    assert all(q[1, j, t] > 0 for j, t in enumerate(proposal.tokens[1]))
    assert np.asarray(drafter.propose(requests, K + 2).probs).shape == (2, K + 2, cfg.vocab)  # k > block: padded
    greedy = drafter.propose([DraftRequest(0, list(range(7)), 1, SamplingParams(temperature=0.0), 3, K)], K)
    assert greedy.probs is None and len(greedy.tokens[0]) == K  # all greedy: argmax drafts, no distribution


def test_greedy_verification_without_the_sampling_path_is_the_same():
    rng = np.random.default_rng(5)
    num_seqs, vocab = 6, 32
    logits = rng.normal(size=(num_seqs * (K + 1), vocab)).astype(np.float32)
    argmax = logits.argmax(-1).reshape(num_seqs, K + 1)
    drafts = np.where(rng.random((num_seqs, K)) < 0.7, argmax[:, :K], (argmax[:, :K] + 1) % vocab).astype(np.int32)
    counts = rng.integers(0, K + 1, num_seqs).astype(np.int32)
    b = sampling_batch([SampleRow(SamplingParams(temperature=0.0), s, j, (), ())
                        for s in range(num_seqs) for j in range(K + 1)])
    run = jax.jit(verify, static_argnames=("num_top", "draw"))
    full = run(logits, b, drafts, counts, None, draw=True)
    greedy_only = run(logits, b, drafts, counts, None, draw=False)
    assert all(np.array_equal(x, y) for x, y in zip(full, greedy_only, strict=True))
    assert 0 < int(np.asarray(full.num_accepted).sum()) < int(counts.sum())


# --------------------------------------------------------------------------- training


def test_training_prompts_schedule_and_config_checks():
    train_prompts, held_out = chat_prompts(64)
    texts = [p[0]["content"] for p in train_prompts]
    assert len(held_out) == 64 and len(texts) > 10_000 and len(set(texts)) == len(texts)
    assert not {p[0]["content"] for p in held_out} & set(texts)
    tc = TrainConfig(lr=1.0, warmup=10)
    assert lr_at(tc, 0, 0.0) == pytest.approx(0.1) and lr_at(tc, 9, 0.0) == pytest.approx(1.0)
    assert lr_at(tc, 100, 0.5) == pytest.approx(0.55) and lr_at(tc, 100, 1.0) == pytest.approx(FINAL_LR_SHARE)
    with pytest.raises(ValueError, match=r"TrainConfig.decay = 0: expected in \(0, 1\]"):
        TrainConfig(decay=0)
    with pytest.raises(ValueError, match="TrainConfig.gen_batch = 0: expected >= 1"):
        TrainConfig(gen_batch=0)
    with pytest.raises(ValueError, match="TrainConfig.gen_temperature = -1: expected >= 0"):
        TrainConfig(gen_temperature=-1)
    with pytest.raises(ValueError, match="num_held_out=0: expected 0 < num_held_out"):
        chat_prompts(0)


def test_batched_greedy_answers_equal_the_engines():
    """The fixed-shape device loop answers like the engine: waves of 3 over 4 prompts (the last wave padded),
    each answer cut after its first eos."""
    cfg, params = target()
    prompts = reference()[0] + [reference()[0][0][:5]]
    eng = engine(None)
    want = tokens(eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12)))
    assert answers(cfg, params, prompts, 12, eng.eos_ids, wave=3) == list(zip(prompts, want, strict=True))
    assert len(want[0]) > 5
    stop = want[0][5]  # as if it were an eos: the answer ends at its first occurrence
    cut = answers(cfg, params, prompts[:1], 12, (stop,), wave=3)
    assert cut == [(prompts[0], want[0][:want[0].index(stop) + 1])]


def test_truncated_contexts_lose_the_prompts_cached_blocks():
    """A truncated context keeps only the states a prefix-cache hit leaves: from the prompt's last partial block
    on (train_drafter.BLOCK_SIZE = 16: a 20-token prompt loses 16 states, a 16-token one 0, as the scheduler
    recomputes a whole prompt's last token)."""
    cfg, params = target()
    dcfg = drafter_config(window=24)
    pairs = [(list(range(1, 21)), [5] * 10), (list(range(1, 17)), [6] * 10)]
    data = target_data(cfg, params, pairs, dcfg.target_layers, 64, jnp.float32)
    anchors = jnp.array([22, 30 + 18])  # answer tokens: flat index 22 of the first sequence, 18 of the second
    batch = gather(data, anchors, dcfg)
    assert np.array_equal(batch.computed_from, [16 - 22, 0 - 18])
    kept = truncate_context(batch, jax.random.key(0), prob=1.0).ctx_valid
    positions = np.asarray(anchors)[:, None] + np.asarray(batch.ctx_positions)  # flat indices of the context
    assert np.array_equal(kept[0], positions[0] >= 16) and np.array_equal(kept[1], positions[1] >= 30)
    assert np.array_equal(kept, batch.ctx_valid & (positions >= np.array([[16], [30]])))
    unchanged = truncate_context(batch, jax.random.key(0), prob=0.0).ctx_valid
    assert np.array_equal(unchanged, batch.ctx_valid)


def test_tiny_training_lowers_the_loss_and_raises_acceptance():
    _, curve, before, after = trained()
    assert curve[-1]["loss"] < curve[0]["loss"], curve  # soft labels: the floor is the target's entropy
    assert after["loss"] < before["loss"] - 0.5, (before, after)  # cross-entropy on the greedy tokens
    # The copied top layer starts at 2.1 on the fixture's repetitive greedy outputs; training nearly doubles it.
    assert after["acceptance_length"] > before["acceptance_length"] + 1.5 and after["accuracy_per_position"][0] > 0.8


# --------------------------------------------------------------------------- the engine


def test_greedy_output_is_identical_to_plain_decoding_in_a_batch():
    prompts, greedy = reference()
    stop_at = greedy[0][9]  # a stop token that first appears mid-generation
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop_token_ids=(stop_at,)),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # max_tokens lands mid-draft
              SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)]
    batch = [prompts[0], prompts[0], prompts[1], prompts[1] + prompts[0][:5]]
    plain = tokens(engine(None).generate(batch, params))
    assert plain[0] == greedy[0] and plain[2] == greedy[1][:7]
    for drafter_params in (None, trained()[0]):  # random, then trained
        eng = engine(spec(drafter_params))
        assert tokens(eng.generate(batch, params)) == plain
        stats_ = eng.spec_stats
        assert stats_.num_steps > 0 and eng.drafter.num_passes < stats_.num_steps  # one pass drafts the batch
        assert eng.drafter.slots == {} and eng.drafter.observed == {}  # finished sequences released
    assert stats_.mean_acceptance_length > 2, stats_  # the trained drafter
    with pytest.raises(ValueError, match="prompt_logprobs = 1 on an engine whose drafter .* verifies every step"):
        eng.add_request(prompts[0], SamplingParams(prompt_logprobs=1))  # it observes every pass: none is plain


@pytest.mark.slow  # ~20 s on 2 cores: 2 x 400 sampled requests
def test_seeded_sampling_keeps_the_target_distribution():
    """Tokens 2 and 3 of many seeded samples: the same distribution with the sampling block drafter as without
    speculation (chi-square on their contingency table), and a seed gives the same tokens alone or batched."""
    prompt = reference()[0][0]
    sampled = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seed=s) for s in range(SEEDS)]
    options = dict(max_running=64, token_budget=1024)
    plain = tokens(engine(None, **options).generate([prompt] * SEEDS, sampled))
    eng = engine(spec(trained()[0], sample=True), **options)
    fast = tokens(eng.generate([prompt] * SEEDS, sampled))
    accepted, drafted = eng.spec_stats.num_accepted_tokens, eng.spec_stats.num_draft_tokens
    assert 0.1 * drafted < accepted < drafted  # both paths taken: acceptances and residual draws
    assert fast != plain  # other random streams: equal in distribution, not token for token
    pairs = sorted({tuple(t[1:]) for t in plain + fast})
    table = np.array([[sum(tuple(t[1:]) == p for t in run) for p in pairs] for run in (plain, fast)])
    table = table[:, table.sum(0) >= 5]
    assert table.shape[1] >= 4, table  # several outcomes to tell apart
    assert stats.chi2_contingency(table).pvalue > P_VALUE, table
    alone = tokens(engine(spec(trained()[0], sample=True)).generate([prompt], sampled[5:6]))
    assert alone == fast[5:6]


def test_structured_output_with_the_block_drafter(tmp_path):
    folder = model_folder(tmp_path)
    choice = ConstraintSpec.choice(["alpha", "beta gamma"])
    regex = ConstraintSpec.regex("[0-9]{3}-[a-z]{2}")
    params = [SamplingParams(temperature=0.0, max_tokens=16, constraint=choice),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, constraint=regex)]
    prompts = [[{"role": "user", "content": "Pick one."}], reference()[0][0], [{"role": "user", "content": "Code?"}]]
    plain = engine(None, folder).generate(prompts, params)
    eng = engine(spec(), folder)
    fast = eng.generate(prompts, params)
    assert tokens(fast) == tokens(plain) and eng.spec_stats.num_steps > 0
    assert fast[0].outputs[0].text in ("alpha", "beta gamma")
    assert len(fast[2].outputs[0].text) == 6 and fast[2].outputs[0].text[3] == "-"


def test_serve_command_line_builds_the_block_drafter(tmp_path):
    folder = model_folder(tmp_path)
    dcfg = drafter_config()
    checkpoint = block_model.save(tmp_path / "drafter", dcfg, block_model.init_params(dcfg, target()[0],
                                                                                          jax.random.key(0)))
    options = ["serve", "--model", str(folder), "--dtype", "float32", "--num-blocks", "64"]
    args = parser().parse_args(options + ["--speculative", "block", "--drafter", str(checkpoint)])
    eng, _, _ = api_cli._engine(args)
    assert isinstance(eng.drafter, BlockDrafter) and eng.speculative.k == dcfg.block
    args = parser().parse_args(options + ["--speculative", "block", "--drafter", str(checkpoint),
                                          "--num-speculative-tokens", "2"])
    assert api_cli._engine(args)[0].speculative.k == 2
    with pytest.raises(ValueError, match="--drafter, --num-speculative-tokens and --static-speculation need --spec"):
        api_cli._engine(parser().parse_args(options + ["--drafter", str(checkpoint)]))
