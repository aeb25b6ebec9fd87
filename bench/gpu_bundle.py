"""`make gpu-bundle`: the wheels a bare accelerator machine lacks, for `bench/gpu_run.sh` to install offline.

    python -m bench.gpu_bundle [--dir .gpu-bundle] [--limit-mib 60]

The lent machine (docs/gpu.md) has Python 3.12, torch, transformers 5.17, tokenizers 0.23.2,
huggingface_hub, safetensors, numpy, PyYAML, psutil, but no network and no Ray. The check needs
transformers at this project's pin (its version here, `pyproject.toml`), and transformers checks at
import that `regex` is recent enough, so the bundle holds, for CPython 3.12 on manylinux x86-64:

* transformers at the version installed here (pure Python, about 13 MB);
* regex at the version installed here (a compiled wheel, under 1 MB).

tokenizers is not bundled: the machine's 0.23.2 meets transformers' `>=0.23.1,<0.24` and the check
never tokenizes (its prompts are token ids). Ray is not bundled (its wheel alone is 79 MB, over
the 64 MiB a device call carries). Writes `requirements.txt` (the exact pins, for
`pip install --no-index --find-links`), `COMMIT` (this checkout's commit, which the check records:
the machine gets no `.git`), and fails when the folder passes `--limit-mib`.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

from bench.conditions import parser
from bench.gpu_check import BUNDLE_DIR, commit

BUNDLED = ("transformers", "regex")
"""Distributions the bundle holds, each at the version installed in this environment."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def bundle_requirements() -> list[str]:
    """``name==version`` of every bundled distribution, at the version installed here.

    Raises:
        RuntimeError: one of them is not installed here (install the project first).
    """
    pins = []
    for name in BUNDLED:
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError as e:
            raise RuntimeError(f"{name} is not installed in {sys.prefix}: run `make install` first") from e
    return pins


def download_command(folder: Path, pins: list[str]) -> list[str]:
    """The `pip download` of CPython 3.12 manylinux x86-64 wheels of `pins` (no dependencies) into `folder`."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--dest",
        str(folder),
    ]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + pins


def folder_bytes(folder: Path) -> int:
    """Bytes of the files in `folder` (not recursive)."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def main(argv: list[str] | None = None) -> int:
    p = parser(
        "gpu_bundle",
        __doc__,
        "under a minute with a package index in reach (it downloads two wheels: transformers and regex)",
    )
    p.add_argument("--dir", default=str(BUNDLE_DIR), help="the bundle folder (emptied first)")
    p.add_argument("--limit-mib", type=float, default=60.0, help="fail when the bundle is larger (MiB)")
    args = p.parse_args(argv)
    folder = Path(args.dir)
    try:
        pins = bundle_requirements()
    except RuntimeError as e:
        print(f"gpu-bundle: error: {e}", file=sys.stderr)
        return 2
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rc = subprocess.run(download_command(folder, pins)).returncode
    if rc != 0:
        print(f"gpu-bundle: error: pip download of {' '.join(pins)} failed (exit {rc})", file=sys.stderr)
        return 1
    (folder / "requirements.txt").write_text("\n".join(pins) + "\n")
    (folder / "COMMIT").write_text((commit() or "unknown") + "\n")
    for wheel in sorted(folder.glob("*.whl")):
        print(f"gpu-bundle: {wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB", file=sys.stderr)
    total = folder_bytes(folder)
    print(f"gpu-bundle: {folder}: {total / 2**20:.1f} MiB in all", file=sys.stderr)
    if total > args.limit_mib * 2**20:
        print(f"gpu-bundle: error: {total / 2**20:.1f} MiB is over --limit-mib {args.limit_mib:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
