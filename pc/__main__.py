"""``python -m pc train``: supervised PC training from the command line.

Each epoch is one jitted call (``pc.train_epoch``). After every epoch the params, optimizer state and epoch
are checkpointed (``apex_jax.checkpoint``) and a JSON line is appended to ``OUT/log.jsonl``. The shuffle of
epoch e uses ``fold_in(key(seed), e)``, so ``--resume`` continues bit-identically: same params, optimizer
state, RNG and data order as a run that was never interrupted. The first start stores the options that define
the run (all but --epochs, --resume and --out) in ``OUT/config.json``; ``--resume`` with any of them changed is
an error.

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
LOG, CONFIG = "log.jsonl", "config.json"
NOT_CONFIG = ("command", "epochs", "resume", "out")  # how long and where a run trains, not what it trains


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
    t.add_argument("--residual", action="store_true",
                   help="muPC: equal-width hidden layers become residual blocks; standard Gaussian weights scaled "
                        "1/sqrt(D) (input), 1/sqrt(N L) (blocks), 1/N (output)")
    t.add_argument("--linear-input", action="store_true",
                   help="feed pixels linearly, mu_1 = x_0 W_0 + b_0 (default: f(x_0), as in Whittington & Bogacz)")
    t.add_argument("--precision", choices=PRECISIONS,
                   help="matmul precision: how matmuls round their operands (float32 accumulation); tf32 is "
                        "exact float32 on a CPU (default: float32 with --residual, else tf32)")
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


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Exit with a usage error for option values no run can use."""
    bounds = [
        ("--T (settling steps)", args.T, args.T >= 1, ">= 1"),
        ("--dt", args.dt, args.dt > 0, "> 0"),
        ("--batch", args.batch, args.batch >= 1, ">= 1"),
        ("--epochs", args.epochs, args.epochs >= 1, ">= 1"),
        ("--lr", args.lr, args.lr > 0, "> 0"),
        ("--weight-decay", args.weight_decay, args.weight_decay >= 0, ">= 0"),
        ("--label-smoothing", args.label_smoothing, 0 <= args.label_smoothing < 1, "in [0, 1)"),
        ("--limit", args.limit, args.limit is None or args.limit >= 1, ">= 1"),
    ]
    for name, value, ok, expected in bounds:
        if not ok:
            parser.error(f"{name} must be {expected}, got {value}")


def run_config(args: argparse.Namespace) -> dict:
    """The options that define the run (all but NOT_CONFIG; --data-path made absolute), as JSON stores them."""
    config = {k: v for k, v in vars(args).items() if k not in NOT_CONFIG}
    if config["data_path"] is not None:
        config["data_path"] = str(pathlib.Path(config["data_path"]).resolve())
    return json.loads(json.dumps(config))


def train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[dict]:
    """Runs the epochs; returns the log records written by this call."""
    try:
        net = PCNet(parse_arch(args.arch), activation=args.activation, output=args.output, residual=args.residual,
                    input_activation=not args.linear_input, precision=args.precision)
        data = load_dataset(args.dataset, args.data_path)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    classes = int(max(data.train_y.max(), data.test_y.max())) + 1
    if data.train_x.shape[1] != net.sizes[0] or classes != net.sizes[-1]:
        parser.error(f"--arch {args.arch} does not fit {args.dataset}: it has {data.train_x.shape[1]} inputs and "
                     f"{classes} classes, the arch {net.sizes[0]} inputs and {net.sizes[-1]} outputs")
    train_x, train_y = data.train_x[: args.limit], data.train_y[: args.limit]
    if args.batch > len(train_x):
        parser.error(f"--batch {args.batch} is more than the {len(train_x)} training images")
    train_x, train_y, test_x, test_y = map(jnp.asarray, (train_x, train_y, data.test_x, data.test_y))

    make = optax.adamw if args.optimizer == "adamw" else apexw
    optimizer = make(args.lr, weight_decay=args.weight_decay)
    key = jax.random.key(args.seed)
    params = init_params(jax.random.fold_in(key, 0), net)
    opt_state = optimizer.init(params)
    out = pathlib.Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out} is a file; expected a folder (new, or an earlier run's)")
    out.mkdir(parents=True, exist_ok=True)
    config = run_config(args) | {"precision": net.precision}  # resolved: a stored default still means what it did
    records = []
    with Checkpointer(out / "checkpoints", max_to_keep=2) as ckpt:
        done = ckpt.latest_step() or 0
        if args.resume:
            if not done:
                parser.error(f"--resume: no checkpoint in {out / 'checkpoints'}")
            _check_config(out / CONFIG, config, parser)
            try:
                state = ckpt.restore({"params": params, "opt_state": opt_state})
            except ValueError as err:  # a run from before config.json, trained with another --arch or --optimizer
                parser.error(f"--resume: the checkpoint in {out / 'checkpoints'} does not match --arch {args.arch} "
                             f"--optimizer {args.optimizer} ({err})")
            params, opt_state = state["params"], state["opt_state"]
            _truncate_log(out / LOG, done)
        elif done:
            parser.error(f"{out} already holds a run (checkpoints up to epoch {done}): pass --resume to continue it, "
                         "or another --out")
        (out / CONFIG).write_text(json.dumps(config, indent=1) + "\n")  # on --resume: the same, or the missing one
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
                uphill = f"  diverged {record['diverged']:.1%}: lower --dt" if record.get("diverged") else ""
                progress.update(bar, advance=1, info=f"energy {record['energy']:.4g}  test acc "
                                                      f"{record['test_accuracy']:.2%}  {seconds:.1f} s{uphill}")
                if ckpt.sigterm_received:
                    break
    return records


def _check_config(path: pathlib.Path, config: dict, parser: argparse.ArgumentParser) -> None:
    """Exit naming every option whose value differs from the run's stored ``config``."""
    if not path.exists():
        print(f"warning: no {path} (a run from before configs were stored): its options cannot be checked",
              file=sys.stderr)
        return
    stored = json.loads(path.read_text())
    changed = [f"--{k.replace('_', '-')} {stored.get(k)!r} -> {v!r}" for k, v in config.items() if stored.get(k) != v]
    if changed:
        parser.error(f"--resume with options that differ from the run stored in {path} (stored -> given): "
                     f"{', '.join(changed)}; resume with the stored values, or train a new run in another --out")


def _truncate_log(path: pathlib.Path, epochs: int) -> None:
    """Drop log lines of epochs after the checkpoint being resumed (they will be trained again)."""
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["epoch"] <= epochs]
        path.write_text("".join(line + "\n" for line in kept))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    return train(args, parser)


if __name__ == "__main__":
    main(sys.argv[1:])
