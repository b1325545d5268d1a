"""Command line: ``python -m serving <command>``.

    python -m serving quantize --model smollm2 --kind int8 --out /tmp/smollm2-int8
    python -m serving quantize --model path/to/hf_folder_or.gguf --kind fp8 --out DIR [--dtype float32]
    python -m serving serve --model smollm2|PATH [--host --port --api-key --max-running --max-queue ...]
    python -m serving chat [--url URL | --model smollm2|PATH]

``serve`` and ``chat`` (the HTTP API and a streaming terminal chat) are described in ``serving.api.cli``.

``quantize`` loads a checkpoint (the embedded SmolLM2-135M-Instruct, a HF safetensors folder, also a published
block-scaled fp8 one, dequantized at load, or a GGUF file) in ``--dtype``, quantizes its attention and MLP/expert
projections per output channel (``serving.quantization.quantize_params``) and writes a folder
``serving.loaders.load_model`` reads back as quantized params, with the tokenizer files beside it.
"""

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from serving import enable_command_buffers, quantization, weights
from serving.api import cli as api_cli
from serving.config import QUANT_METHOD, ModelConfig
from serving.json_files import read_json
from serving.llm_engine import DTYPES
from serving.loaders import quantized
from serving.loaders.gguf import load_gguf
from serving.loaders.safetensors import read_tensors
from serving.models import model_module
from serving.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2"  # --model name of the embedded SmolLM2-135M-Instruct GGUF
# Files of a HF folder that describe its tokenizer and generation defaults: copied next to the quantized weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def write_gguf_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    """A GGUF's tokenizer as the HF files ``Tokenizer.from_hf_folder`` reads."""
    tokenizer.hf.save(str(folder / "tokenizer.json"))
    config = {**tokenizer.special_tokens, "chat_template": tokenizer.chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": list(tokenizer.eos_token_ids)}, indent=2) + "\n")


def quantize_command(args: argparse.Namespace) -> Path:
    """Load ``args.model``, quantize it to ``args.kind``, write ``args.out``; returns the folder written."""
    source = weights.default_model_gguf() if args.model == DEFAULT_MODEL else Path(args.model)
    out = Path(args.out)
    if source.is_dir():
        qconfig = quantized.quantization_config(source)
        if qconfig is not None and qconfig.get("quant_method") == QUANT_METHOD:  # others dequantize at load or fail
            raise ValueError(f"--model {args.model!r} is already quantized ({qconfig}): expected an unquantized "
                             "checkpoint")
        hf_config = read_json(source / "config.json")
        tensors, tokenizer = read_tensors(source), None
    elif source.is_file():
        hf_config, tensors, tokenizer = load_gguf(source)
    else:
        raise FileNotFoundError(f"--model {args.model!r}: expected {DEFAULT_MODEL!r}, a HF checkpoint folder or "
                                "a .gguf file")
    cfg = ModelConfig.from_hf(hf_config)
    params = model_module(cfg.family).params_from_hf(cfg, tensors, DTYPES[args.dtype])
    quantized.save_quantized(out, hf_config, quantization.quantize_params(params, args.kind, cfg))
    if tokenizer is not None:
        write_gguf_tokenizer(tokenizer, out)
    else:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
    return out


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="python -m serving", description=__doc__.split("\n")[0])
    commands = main.add_subparsers(dest="command", required=True)
    q = commands.add_parser("quantize", help="write an int8/fp8 weight-quantized checkpoint folder")
    q.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"{DEFAULT_MODEL!r} (the embedded SmolLM2-135M-Instruct), a HF folder or a .gguf file")
    q.add_argument("--kind", required=True, choices=list(quantization.KINDS))
    q.add_argument("--out", required=True, help="folder to write (created; existing files are overwritten)")
    q.add_argument("--dtype", default="bfloat16", choices=list(DTYPES),
                   help="dtype of the weights that are quantized and of those kept unquantized")
    q.set_defaults(run=quantize_command)
    api_cli.add_commands(commands)
    return main


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    print(args.run(args))


if __name__ == "__main__":
    enable_command_buffers()
    sys.exit(main())
