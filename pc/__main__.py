"""``python -m pc train``: supervised PC training from the command line.

Each epoch is one jitted call (``pc.train_epoch``). After every epoch the params, optimizer state and epoch
are checkpointed (``apex_jax.checkpoint``) and a JSON line is appended to ``OUT/log.jsonl``. The shuffle of
epoch e uses ``fold_in(key(seed), e)``, so ``--resume`` continues bit-identically: same params, optimizer
state, RNG and data order as a run that was never interrupted.

    python -m pc train --dataset mnist --arch 784-512-512-10 --activation sigmoid --T 20 --batch 250 \\
        --epochs 10 --solver euler --out runs/deepity
"""

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import optax
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from apex_jax import apexw
from apex_jax.checkpoint import Checkpointer
from pc.data import DATASETS, load_dataset
from pc.networks import ACTIVATIONS, OUTPUTS, PRECISIONS, PCNet, init_params, parse_arch
from pc.settle import SOLVERS
from pc.train import evaluate, train_epoch

OPTIMIZERS = ("adamw", "apexw")
LOG = "log.jsonl"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pc", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a supervised PC network")
    t.add_argument("--dataset", choices=DATASETS, default="mnist")
    t.add_argument("--data-path", help="IDX folder (fashion-mnist) or .npz file (npz)")
    t.add_argument("--arch", default="784-512-512-10", help="layer widths, e.g. 784-128*3-10")
    t.add_argument("--activation", choices=tuple(ACTIVATIONS), default="sigmoid")
    t.add_argument("--output", choices=OUTPUTS, default="cross_entropy", help="energy of the clamped label")
    t.add_argument("--linear-input", action="store_true",
                   help="feed pixels linearly, mu_1 = x_0 W_0 + b_0 (default: f(x_0), as in Whittington & Bogacz)")
    t.add_argument("--precision", choices=PRECISIONS, default="tf32",
                   help="matmul operands (float32 accumulation); tf32 is exact float32 on a CPU")
    t.add_argument("--T", type=int, default=20, help="settling steps per minibatch")
    t.add_argument("--dt", type=float, default=0.1, help="settling step size")
    t.add_argument("--solver", choices=SOLVERS, default="euler")
    t.add_argument("--batch", type=int, default=250)
    t.add_argument("--epochs", type=int, default=1, help="train until this many epochs are done")
    t.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="weight optimizer")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--weight-decay", type=float, default=1e-4)
    t.add_argument("--label-smoothing", type=float, default=0.0,
                   help="eps of the clamped targets (1 - eps) one_hot(y) + eps / classes, in [0, 1)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--limit", type=int, help="train on the first N images only (quick runs)")
    t.add_argument("--out", default="runs/pc", help="folder for log.jsonl and checkpoints/")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    return parser


def train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[dict]:
    """Runs the epochs; returns the log records written by this call."""
    try:
        net = PCNet(parse_arch(args.arch), activation=args.activation, output=args.output,
                    input_activation=not args.linear_input, precision=args.precision)
        data = load_dataset(args.dataset, args.data_path)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    if data.train_x.shape[1] != net.sizes[0] or data.train_y.max() >= net.sizes[-1]:
        parser.error(f"--arch {args.arch} does not fit {args.dataset}: it has {data.train_x.shape[1]} inputs and "
                     f"{int(data.train_y.max()) + 1} classes, the arch {net.sizes[0]} inputs and {net.sizes[-1]} "
                     "outputs")
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    if not 0 <= args.label_smoothing < 1:
        parser.error(f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
    train_x, train_y = data.train_x[: args.limit], data.train_y[: args.limit]
    train_x, train_y, test_x, test_y = map(jnp.asarray, (train_x, train_y, data.test_x, data.test_y))

    make = optax.adamw if args.optimizer == "adamw" else apexw
    optimizer = make(args.lr, weight_decay=args.weight_decay)
    key = jax.random.key(args.seed)
    params = init_params(jax.random.fold_in(key, 0), net)
    opt_state = optimizer.init(params)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    with Checkpointer(out / "checkpoints", max_to_keep=2) as ckpt:
        done = 0
        if args.resume:
            done = ckpt.latest_step() or parser.error(f"--resume: no checkpoint in {out / 'checkpoints'}")
            state = ckpt.restore({"params": params, "opt_state": opt_state})
            params, opt_state = state["params"], state["opt_state"]
            _truncate_log(out / LOG, done)
        columns = [TextColumn("epoch {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"),
                   TimeElapsedColumn()]
        with Progress(*columns) as progress:
            bar = progress.add_task("train", total=args.epochs, completed=done, info="compiling")
            for epoch in range(done + 1, args.epochs + 1):
                start = time.perf_counter()
                params, opt_state, metrics = train_epoch(
                    params, opt_state, optimizer, train_x, train_y, net=net, T=args.T, dt=args.dt,
                    batch_size=args.batch, key=jax.random.fold_in(key, epoch), solver=args.solver,
                    label_smoothing=args.label_smoothing)
                jax.block_until_ready(params)
                seconds = time.perf_counter() - start
                record = {"epoch": epoch, "seconds": seconds, "test_accuracy": evaluate(params, test_x, test_y, net),
                          **{k: float(v) for k, v in metrics.items()}}
                ckpt.save(epoch, {"params": params, "opt_state": opt_state}, force=True)
                with open(out / LOG, "a") as log:
                    log.write(json.dumps(record) + "\n")
                records.append(record)
                progress.update(bar, advance=1, info=f"energy {record['energy']:.4g}  "
                                                      f"test acc {record['test_accuracy']:.2%}  {seconds:.1f} s")
                if ckpt.sigterm_received:
                    break
    return records


def _truncate_log(path: pathlib.Path, epochs: int) -> None:
    """Drop log lines of epochs after the checkpoint being resumed (they will be trained again)."""
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["epoch"] <= epochs]
        path.write_text("".join(line + "\n" for line in kept))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.T < 1:
        parser.error(f"--T (settling steps) must be >= 1, got {args.T}")
    return train(args, parser)


if __name__ == "__main__":
    main(sys.argv[1:])
