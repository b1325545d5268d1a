"""`make device-wheels`: every wheel the GPU machine lacks, downloaded into the git-ignored `.whl/`.

The GPU machine has no network; its image holds jax, torch and most of the scientific stack
(`tools/gpu_image_packages.txt`), and a device call may carry 64 MiB of files beside the working tree. The
project's needs there are the dependency closure of `apex-jax[bench]` as installed in this `.venv` (so the
versions are the pinned ones of `constraints.txt`), less what the image holds, as CPython 3.12 x86-64 wheels;
then the data wheels (MNIST, the SmolLM2 weights) while they fit in what is left of a call's 64 MiB. A data
wheel that does not fit is left out, with the steps to carry it in pieces. One `carry: [".whl"]` then brings
everything `make gpu-check` and the benchmarks import; `tools/gpu_check.py` installs it there.
"""

import argparse
import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
IMAGE_PACKAGES = Path(__file__).with_name("gpu_image_packages.txt")
CARRY_LIMIT_BYTES = 64 << 20  # what one device call may carry: the working tree and the carried paths together
EXTRAS = ("bench",)  # the benchmarks' imports too: gpu-check runs them
# The GPU machine's interpreter and platform; manylinux tags from 2_17 to 2_39 (pip matches N exactly).
PLATFORM_ARGS = ("--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:", "--no-deps",
                 *(arg for n in range(17, 40) for arg in ("--platform", f"manylinux_2_{n}_x86_64")),
                 "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_closure(project: str = "apex-jax", extras: tuple[str, ...] = EXTRAS) -> dict[str, str]:
    """{canonical name: installed version} of ``project`` and everything it requires (with ``extras``)."""
    found, todo = {}, [(project, extras)]
    while todo:
        name, wanted = todo.pop()
        key = canonical(name)
        if key in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"error: {name} is not installed in {sys.executable}; run `make venv`") from None
        found[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *wanted)):
                todo.append((req.name, tuple(req.extras)))
    return found


def image_packages() -> set[str]:
    lines = IMAGE_PACKAGES.read_text().splitlines()
    return {canonical(line) for line in lines if line.strip() and not line.startswith("#")}


def data_wheels() -> list[tuple[str, str, str]]:
    """(pip spec, sha256, env variable) of each wheel that carries data or weights."""
    from apex_data.mnist import MNIST_WHEEL_ENV, MNIST_WHEEL_SHA256, MNIST_WHEEL_SPEC
    from serving.weights import SMOLLM2_WHEEL_ENV, SMOLLM2_WHEEL_SHA256, SMOLLM2_WHEEL_SPEC
    return [(MNIST_WHEEL_SPEC, MNIST_WHEEL_SHA256, MNIST_WHEEL_ENV),
            (SMOLLM2_WHEEL_SPEC, SMOLLM2_WHEEL_SHA256, SMOLLM2_WHEEL_ENV)]


def working_tree_bytes() -> int:
    """Bytes of what a device call sends besides carried paths: tracked and untracked, not ignored, files."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def download(spec: str, dest: Path) -> Path:
    before = set(dest.glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", *PLATFORM_ARGS,
                    "-d", str(dest), spec], check=True)
    new = set(dest.glob("*.whl")) - before
    name = canonical(spec.split("==")[0])
    return next(iter(new)) if new else next(w for w in dest.glob("*.whl") if canonical(w.name.split("-")[0]) == name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-data", action="store_true", help="leave out the data and weight wheels")
    args = parser.parse_args(argv)
    WHEELS.mkdir(exist_ok=True)
    have = image_packages()
    missing = {n: v for n, v in dependency_closure().items() if n not in have and n != "apex-jax"}
    keep = set()
    for name, version in sorted(missing.items()):
        keep.add(download(f"{name}=={version}", WHEELS))
    tree = working_tree_bytes()
    room = CARRY_LIMIT_BYTES - tree - sum(w.stat().st_size for w in keep)
    left_out = []
    if not args.no_data:
        from apex_data import fetch_wheel
        for spec, sha256, env in data_wheels():
            wheel = fetch_wheel(spec, sha256, env, WHEELS)
            if wheel.stat().st_size <= room:
                keep.add(wheel)
                room -= wheel.stat().st_size
            else:
                wheel.unlink()
                left_out.append((spec, env, wheel.name))
    for stale in set(WHEELS.glob("*.whl")) - keep:  # one version of each: two would stop the install there
        stale.unlink()
    total = sum(w.stat().st_size for w in keep)
    print(f"{len(keep)} wheels in {WHEELS} ({total / 2**20:.1f} MiB; {room / 2**20:.1f} MiB left of a call's "
          f"64 MiB beside the {tree / 2**20:.1f} MiB working tree): carry [\".whl\"]")
    for spec, env, name in left_out:
        print(f"left out {spec} (too large for one call). To carry it: download it into an ignored folder "
              f"(`pip download --no-deps -d .big {spec}`), `split -b 40M .big/{name} .big/part-`, carry the parts "
              f"over two calls within the machine's warm window (copy each call's parts to /tmp/keep there), "
              f"then `cat /tmp/keep/part-* > /tmp/keep/{name}` and set {env}=/tmp/keep/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
