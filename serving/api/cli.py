"""``python -m serving serve`` and ``python -m serving chat`` (added to ``serving/__main__.py``'s parser).

    python -m serving serve --model smollm2 --port 8000 [--host 0.0.0.0 --api-key KEY] [--max-running 32 ...]
    python -m serving serve --model path/to/config.json --random-weights   # a HF config, random weights
    python -m serving serve --speculative block --drafter DIR   # speculative decoding (or --speculative ngram)
    python -m serving serve --decode-steps 4   # up to 4 decode steps per device call (Engine(decode_steps=))
    python -m serving serve --dtype float32 --compilation-cache DIR   # or --no-compilation-cache
    python -m serving chat [--url http://127.0.0.1:8000/v1 --api-key KEY]   # without --url: serves --model itself
    python -m serving serve --model DIR --tensor-parallel 2 --expert-parallel 4   # on 8 devices

``--data-parallel``, ``--tensor-parallel`` and ``--expert-parallel`` (default 1 each: one device) run the engine
on a ``data x tensor x expert`` mesh (``serving.sharding``) of every device this process sees, so their product
must equal that number (``CUDA_VISIBLE_DEVICES`` picks the GPUs): experts split over ``expert``, attention heads
and hidden dims over ``tensor``, the MoE layers' tokens over ``data x expert`` (attention is not split over
them). One host: ``serve`` drives the engine from one process; a mesh across hosts (``jax.distributed``, see
``serving.sharding``) would need every process to run the same steps, which it does not do.

``--random-weights`` serves a model that exists only as a HF ``config.json`` (load tests and benchmarks of a
shape, not of answers): ``--model`` names the config file or the folder holding it; the weights are the model
family's ``init_params`` (seed ``RANDOM_WEIGHTS_SEED``) in ``--dtype``, and a ``tokenizer.json`` beside the config
is used when there is one (without it, prompts must be token ids on ``/v1/completions``).

Defaults are the engine's (``serving.engine.engine``): ``--dtype auto`` (bfloat16 on a GPU, float32 on the CPU),
``--decode-steps`` by backend (``DECODE_STEPS``), ``--prefill-chunk`` half the token budget, and JAX's persistent
compilation cache in ``jax-compilation`` under ``$APEX_JAX_CACHE`` (default ``~/.cache/apex-jax``).

The API key may also come from the ``SERVING_API_KEY`` environment variable (keeps it out of ``ps``); it is
never printed or logged.
"""

import argparse
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from serving import sharding
from serving.api.security import DEFAULT_HOST, MAX_BODY_BYTES, check_bind
from serving.api.server import Server, create_app, serve
from serving.config import ModelConfig
from serving.engine.engine import Engine, LoadedModel, eos_from_folder, resolve_dtype
from serving.models import model_module
from serving.speculative import SPECULATIVE_METHODS, SpecConfig
from serving.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2"  # the embedded SmolLM2-135M-Instruct
API_KEY_ENV = "SERVING_API_KEY"
DTYPES = ("auto", "bfloat16", "float32")  # --dtype: names Engine takes (serving.engine.engine.resolve_dtype)
EXIT_WORDS = ("/exit", "/quit")
RANDOM_WEIGHTS_SEED = 0  # --random-weights: the same weights on every run, so runs compare


def _config_file(model: str) -> Path:
    """The HF config.json that ``--model`` names for ``--random-weights`` (the file, or the folder holding it)."""
    if model == DEFAULT_MODEL:
        raise ValueError(f"--random-weights with --model {model!r}: expected a HF config.json or its folder")
    path = Path(model)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file() or config.suffix != ".json":
        raise FileNotFoundError(f"--random-weights --model {model!r}: expected a HF config.json file or a folder "
                                "holding one")
    return config


def _load_random(config: Path, dtype: jnp.dtype) -> LoadedModel:
    """Random weights of the model ``config`` describes, with the tokenizer beside it if any."""
    cfg = ModelConfig.from_hf(json.loads(config.read_text()))
    params = model_module(cfg.family).init_params(cfg, jax.random.key(RANDOM_WEIGHTS_SEED), dtype)
    folder = config.parent
    tokenizer = Tokenizer.from_hf_folder(folder) if (folder / "tokenizer.json").is_file() else None
    return LoadedModel(cfg, params, tokenizer, tokenizer.eos_token_ids if tokenizer else eos_from_folder(folder))


def _mesh(args: argparse.Namespace) -> Mesh | None:
    """The ``data x tensor x expert`` mesh of ``--data-parallel``, ``--tensor-parallel`` and ``--expert-parallel``
    over every device, or None (one device) when all three are 1."""
    sizes = {"--data-parallel": args.data_parallel, "--tensor-parallel": args.tensor_parallel,
             "--expert-parallel": args.expert_parallel}
    named = " x ".join(f"{flag} {n}" for flag, n in sizes.items())
    if min(sizes.values()) < 1:
        raise ValueError(f"{named}: expected sizes >= 1")
    devices = math.prod(sizes.values())
    if devices == 1:
        return None
    if devices != jax.device_count():
        raise ValueError(f"{named} = {devices} devices: expected their product to be the {jax.device_count()} "
                         f"{jax.default_backend()} devices this process sees (CUDA_VISIBLE_DEVICES picks the GPUs)")
    return sharding.make_mesh(*sizes.values())


def _engine(args: argparse.Namespace) -> tuple[Engine, str, Path | None]:
    """(engine, served model name, model path or None) for ``--model`` (and ``--random-weights``)."""
    if args.speculative is None and (args.drafter or args.num_speculative_tokens):
        raise ValueError("--drafter and --num-speculative-tokens need --speculative (ngram or block)")
    options = dict(dtype=args.dtype, num_blocks=args.num_blocks, block_size=args.block_size,
                   max_running=args.max_running, token_budget=args.token_budget, max_model_len=args.max_model_len,
                   max_queue=args.max_queue, batch_invariant=args.batch_invariant, mesh=_mesh(args),
                   decode_steps=args.decode_steps, prefill_chunk=args.prefill_chunk,
                   compilation_cache=args.compilation_cache,
                   speculative=SpecConfig.from_method(args.speculative, args.drafter, args.num_speculative_tokens)
                   if args.speculative else None)
    if args.random_weights:
        config = _config_file(args.model)
        engine = Engine(_load_random(config, resolve_dtype(args.dtype, config.parent)), **options)
        return engine, args.name or config.parent.resolve().name, config.parent
    path = None if args.model == DEFAULT_MODEL else Path(args.model)
    if path is not None and not path.exists():
        raise FileNotFoundError(f"--model {args.model!r}: expected {DEFAULT_MODEL!r}, a HF folder or a .gguf file")
    if path is not None and path.suffix == ".json":
        raise ValueError(f"--model {args.model!r} is a config without weights: add --random-weights to serve it "
                         "with random weights, or pass a HF folder or a .gguf file")
    engine = Engine(path, **options)
    return engine, args.name or (DEFAULT_MODEL if path is None else path.name), path


def serve_command(args: argparse.Namespace) -> str:
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    try:
        check_bind(args.host, api_key)  # before the minutes of loading a model
    except ValueError as e:
        raise SystemExit(f"serve refuses to start: {e}") from None
    engine, name, path = _engine(args)
    models_root = Path(args.models_root) if args.models_root else None
    app = create_app(engine, name, model_path=path, models_root=models_root, api_key=api_key,
                     max_body_bytes=args.max_body_bytes)
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1 (API key {'required' if api_key else 'off'})")
    serve(app, args.host, args.port, api_key, args.log_level)
    return "server stopped"


def chat_loop(client, model: str, read: Callable[[str], str], console, system: str | None = None,
              max_tokens: int = 512, temperature: float = 0.7) -> list[dict]:
    """Read user turns with ``read`` until EOF or /exit, stream each answer to the rich ``console``; returns
    the conversation."""
    messages = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            text = read("[bold green]you>[/] ")
        except EOFError:
            return messages
        if text.strip() in EXIT_WORDS:
            return messages
        messages.append({"role": "user", "content": text})
        console.print("[bold blue]assistant>[/] ", end="")
        reply = ""
        for chunk in client.chat.completions.create(model=model, messages=messages, stream=True,
                                                    max_tokens=max_tokens, temperature=temperature):
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta:
                reply += delta
                console.print(delta, end="", markup=False, highlight=False)
        console.print()
        messages.append({"role": "assistant", "content": reply})


def chat_command(args: argparse.Namespace) -> str:
    import openai
    from rich.console import Console

    console = Console()
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or "unused"

    def run(url: str, model: str) -> list[dict]:
        client = openai.OpenAI(base_url=url, api_key=api_key)
        return chat_loop(client, model, console.input, console, args.system, args.max_tokens, args.temperature)

    if args.url:
        messages = run(args.url, args.name or args.model)
    else:
        engine, name, _ = _engine(args)
        with Server(create_app(engine, name)) as server:
            console.print(f"[dim]{name} on {server.url} - /exit or Ctrl-D to leave[/]")
            messages = run(f"{server.url}/v1", name)
    return f"{sum(m['role'] == 'user' for m in messages)} turns"


def _engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"{DEFAULT_MODEL!r} (the embedded SmolLM2-135M-Instruct), a HF folder or a .gguf file")
    parser.add_argument("--name", help="the model name clients use (default: smollm2 or the folder name)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="params and cache dtype; auto: bfloat16 on a GPU (float16 for a float16 checkpoint), "
                             "float32 on the CPU")
    parser.add_argument("--max-running", type=int, default=32, help="sequences run per step")
    parser.add_argument("--max-queue", type=int, default=64, help="sequences waiting beyond max-running; more: 503")
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV cache blocks")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument("--token-budget", type=int, default=512, help="new tokens per step (chunked prefill)")
    parser.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                        help="prefill tokens running sequences take per step while others wait to be admitted "
                             "(default: half the token budget)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--random-weights", action="store_true",
                        help="--model is a HF config.json (or its folder): serve that shape with random weights")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="a request's output is bitwise the same in any batch (serving.batch_invariant; slower)")
    parser.add_argument("--decode-steps", type=int, default=None, metavar="N",
                        help="decode steps per device call when every running sequence decodes (the same tokens; "
                             "a step with a prefill or a constrained row runs one; default: by backend, 1 on the CPU)")
    parser.add_argument("--compilation-cache", default=True, metavar="DIR",
                        help="JAX's persistent compilation cache (default: jax-compilation in $APEX_JAX_CACHE, "
                             "itself ~/.cache/apex-jax by default)")
    parser.add_argument("--no-compilation-cache", dest="compilation_cache", action="store_false",
                        help="do not turn the persistent compilation cache on")
    parser.add_argument("--speculative", default=None, choices=list(SPECULATIVE_METHODS),
                        help="speculative decoding: n-gram prompt lookup, or a block drafter (--drafter)")
    parser.add_argument("--drafter", default=None, help="block drafter checkpoint (python -m serving.train_drafter)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="draft tokens per step (default: 4 for ngram, the drafter's trained block for block)")
    parallel = parser.add_argument_group(
        "parallelism", "a data x tensor x expert mesh over every device of this host: the product of the three must "
        "equal their number (all 1: one device). One host only (serving.sharding; a multi-host mesh, through "
        "jax.distributed, would need every process to run the engine's steps)")
    parallel.add_argument("--data-parallel", type=int, default=1, metavar="N",
                          help="splits the MoE layers' tokens (with --expert-parallel); attention is replicated")
    parallel.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                          help="splits attention heads, the MLP and expert hidden dims, the vocabulary, the KV cache")
    parallel.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                          help="splits the routed experts (tokens sent to them by all-to-all)")


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Add ``serve`` and ``chat`` to ``python -m serving``'s subcommands."""
    s = commands.add_parser("serve", help="serve the OpenAI- and Anthropic-compatible HTTP API")
    _engine_options(s)
    s.add_argument("--host", default=DEFAULT_HOST, help="bind address; beyond loopback it needs --api-key")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help=f"required bearer key (or ${API_KEY_ENV})")
    s.add_argument("--models-root", default=None, help="folder under which clients may name the model by path")
    s.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(run=serve_command)
    c = commands.add_parser("chat", help="chat in the terminal (streaming), with a server or an in-process one")
    _engine_options(c)
    c.add_argument("--url", default=None, help="a server's /v1 URL (default: serve --model in-process)")
    c.add_argument("--api-key", default=None, help=f"the server's key (or ${API_KEY_ENV})")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--max-tokens", type=int, default=512)
    c.add_argument("--temperature", type=float, default=0.7)
    c.set_defaults(run=chat_command)
