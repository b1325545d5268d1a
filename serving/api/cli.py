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

``serve`` runs the engine in an engine core process of its own (``serving.api.engine_core``) built from an
``EngineSpec`` of these options, and HTTP, tokenization, JSON and SSE in this one (which then keeps JAX on the
CPU: it never takes device memory); ``--in-process`` runs the engine on a thread of the server's process.

``--random-weights`` serves a model that exists only as a HF ``config.json`` (load tests and benchmarks of a
shape, not of answers): ``--model`` names the config file or the folder holding it; the weights are the model
family's ``init_params`` (seed ``engine_spec.RANDOM_WEIGHTS_SEED``) in ``--dtype``, and a ``tokenizer.json``
beside the config is used when there is one (without it, prompts must be token ids on ``/v1/completions``).

Defaults are the engine's (``serving.llm_engine``): ``--dtype auto`` (bfloat16 on a GPU, float32 on the CPU),
``--decode-steps`` by backend (``DECODE_STEPS``), ``--prefill-chunk`` half the token budget, and JAX's persistent
compilation cache in ``jax-compilation`` under ``$APEX_JAX_CACHE`` (default ``~/.cache/apex-jax``).

The API key may also come from the ``SERVING_API_KEY`` environment variable (keeps it out of ``ps``); it is
never printed or logged.
"""

import argparse
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import jax

from serving.api.engine_spec import DEFAULT_MODEL, DTYPES, EngineSpec
from serving.api.images import ImageOptions
from serving.api.profiling import freeze_heap
from serving.api.security import DEFAULT_HOST, MAX_BODY_BYTES, check_bind
from serving.api.server import Server, create_app, serve
from serving.llm_engine import Engine
from serving.spec_decode import SPECULATIVE_METHODS

API_KEY_ENV = "SERVING_API_KEY"
EXIT_WORDS = ("/exit", "/quit")


def _spec(args: argparse.Namespace) -> tuple[EngineSpec, str, Path | None]:
    """(engine spec, served model name, model path or None) for ``--model`` and the engine options."""
    spec = EngineSpec(**{field.name: getattr(args, field.name) for field in dataclasses.fields(EngineSpec)})
    name, path = spec.served_name()
    return spec, args.name or name, path


def _engine(args: argparse.Namespace) -> tuple[Engine, str, Path | None]:
    """(engine built in this process, served model name, model path or None)."""
    spec, name, path = _spec(args)
    return spec.build(), name, path


def serve_command(args: argparse.Namespace) -> str:
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    try:
        check_bind(args.host, api_key)  # before the minutes of loading a model
    except ValueError as e:
        raise SystemExit(f"serve refuses to start: {e}") from None
    try:
        spec, name, path = _spec(args)  # a config.json the engine cannot serve is refused here, naming the key
    except ValueError as e:
        raise SystemExit(f"serve refuses to start: {e}") from None
    if not args.in_process:  # the engine core process owns the devices: this one must not take any
        jax.config.update("jax_platforms", "cpu")
    models_root = Path(args.models_root) if args.models_root else None
    images = ImageOptions(max_images=args.max_images, max_bytes=args.max_image_bytes,
                          allow_remote=args.allow_remote_images)
    app = create_app(spec.build() if args.in_process else spec, name, model_path=path, models_root=models_root,
                     api_key=api_key, max_body_bytes=args.max_body_bytes, image_options=images)
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1 (API key {'required' if api_key else 'off'})")
    freeze_heap()
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
    parser.add_argument("--eager-admission", action="store_true",
                        help="after a sequence finishes, while a slot is free, dispatch the next decode as one step "
                             "so that a request arriving meanwhile waits less (serving.Engine eager_admission)")
    parser.add_argument("--quantize", default=None, choices=("int8", "fp8"),
                        help="quantize the loaded weights per output column before serving (attention and expert "
                             "projections; as `python -m serving quantize` writes them)")
    parser.add_argument("--admission-window", type=float, default=0.0, metavar="F",
                        help="after an event that ended requests, with a device call in flight, the engine core "
                             "waits up to F of that kind of call's measured slack for as many new requests before "
                             "dispatching the next call, which they then join (0: off; "
                             "serving.api.engine_core.AdmissionWindow)")
    parser.add_argument("--compilation-cache", default=True, metavar="DIR",
                        help="JAX's persistent compilation cache (default: jax-compilation in $APEX_JAX_CACHE, "
                             "itself ~/.cache/apex-jax by default)")
    parser.add_argument("--no-compilation-cache", dest="compilation_cache", action="store_false",
                        help="do not turn the persistent compilation cache on")
    parser.add_argument("--host-cache-gb", type=float, default=0.0, metavar="GB",
                        help="host memory for prefix-cache blocks the GPU evicts, loaded back on a hit (0: none)")
    parser.add_argument("--disk-cache", default=None, metavar="DIR",
                        help="a folder for prefix-cache blocks under the host tier (needs --host-cache-gb)")
    parser.add_argument("--persist-disk-cache", action="store_true",
                        help="at stop, write the GPU's cached blocks to --disk-cache too, for the next start")
    parser.add_argument("--speculative", default=None, choices=list(SPECULATIVE_METHODS),
                        help="speculative decoding: n-gram prompt lookup, suffix drafting (own context and recent "
                        "outputs), or a block drafter (--drafter); a request may name another with its "
                        "'speculative' field ('ngram', 'suffix', 'off'). Draft lengths adapt to measured "
                        "acceptance and load")
    parser.add_argument("--drafter", default=None, help="block drafter checkpoint (python -m examples.train_drafter)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="draft tokens per step (default: 4 for ngram, 8 for suffix, the drafter's trained "
                        "block for block)")
    parser.add_argument("--static-speculation", action="store_true",
                        help="draft --num-speculative-tokens every step instead of adapting to acceptance and load")
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
    s.add_argument("--allow-remote-images", action="store_true",
                   help="fetch http(s) image URLs of requests (default: refused with a 400; the server makes no "
                        "outbound requests)")
    s.add_argument("--max-images", type=int, default=ImageOptions.max_images, help="images per request; more: 413")
    s.add_argument("--max-image-bytes", type=int, default=ImageOptions.max_bytes,
                   help="encoded bytes per image; more: 413 (base64 images also count against --max-body-bytes)")
    s.add_argument("--in-process", action="store_true",
                   help="run the engine on a thread of the server's process (default: an engine core process of "
                        "its own, so HTTP, tokenization and JSON do not share a GIL with the scheduler)")
    s.set_defaults(run=serve_command)
    c = commands.add_parser("chat", help="chat in the terminal (streaming), with a server or an in-process one")
    _engine_options(c)
    c.add_argument("--url", default=None, help="a server's /v1 URL (default: serve --model in-process)")
    c.add_argument("--api-key", default=None, help=f"the server's key (or ${API_KEY_ENV})")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--max-tokens", type=int, default=512)
    c.add_argument("--temperature", type=float, default=0.7)
    c.set_defaults(run=chat_command)
