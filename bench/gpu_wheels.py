"""``make gpu-wheels``: download, for a bare GPU machine with no network, the wheels of every
runtime dependency of ``areal`` (and of the GPU check's tests) that its image lacks.

The image (see ``bench/gpu_image.txt``: torch, transformers, accelerate, peft, numpy, pyarrow,
pytest, ...) is Python 3.12 on manylinux x86_64. This resolves the requirement closure of
``areal[test]`` as installed in this venv, drops what the image has, and downloads each remaining
distribution at the version installed here (one version each, ``--no-deps``) into ``.whl/``
(ignored by git), which ``bench/gpu_check.sh`` installs with ``pip --no-index``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "bench" / "gpu_image.txt"  # distributions the GPU image already holds
# ours (on PYTHONPATH); Ray: Core runs in process in the check, and its wheel is ~70 MiB; vulture:
# the dead-code test, not run there
SKIP = {"areal", "ray", "vulture"}
PLATFORMS = [  # pip matches each tag exactly; llguidance 1.9 ships manylinux_2_31 only
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "any",
]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(root: str, extras: set[str], skip: set[str]) -> dict[str, str]:
    """Canonical name -> installed version of ``root`` and everything it needs here, not
    following the distributions in ``skip``."""
    found: dict[str, str] = {}
    todo = [(root, extras)]
    while todo:
        name, want = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a marker-excluded or optional requirement that is not installed
        key = canonical(dist.metadata["Name"])
        if (key in found and not want) or (key in skip and name != root):
            continue
        found[key] = dist.version
        for req in dist.requires or []:
            spec, _, marker = req.partition(";")
            if "extra ==" in marker and not any(f'extra == "{e}"' in marker for e in want):
                continue
            todo.append((re.split(r"[\s\[<>=!~(]", spec.strip(), maxsplit=1)[0], set()))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / ".whl"))
    args = ap.parse_args(argv)
    image = {
        canonical(line.split("#")[0].strip())
        for line in IMAGE.read_text().splitlines()
        if line.split("#")[0].strip()
    }
    needed = {
        k: v
        for k, v in sorted(closure("areal", {"test"}, SKIP).items())
        if k not in image and k not in SKIP
    }
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    for old in out.glob("*.whl"):  # one version each: a stale one would stop the install there
        old.unlink()
    flags = [
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        *[f for p in PLATFORMS for f in ("--platform", p)],
        "-d",
        str(out),
        "-q",
    ]
    for name, version in needed.items():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", *flags, f"{name}=={version}"], check=True
        )
    size = sum(f.stat().st_size for f in out.glob("*.whl")) / 2**20
    print(f"gpu-wheels: {len(needed)} distributions, {size:.1f} MiB in {out}: {' '.join(needed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
