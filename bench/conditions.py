"""What every bench tool shares: the conditions line its tables start with, and its flag vocabulary.

Conditions line (first line of every table a tool prints or writes), one place so that every published table
names the same things: date, commit, model, dtype and why, CPU model and flags, torch threads.

Contention: every row a tool measures carries `replica.cpu_share`'s fields (the CPU its process got of what it
asked for), shown in a ``CPU share`` column (``!`` contended) and listed under the table (`contended_lines`).

Flag vocabulary, the same name for the same thing in every tool:

* lists are comma-separated (``--dtypes float32,bfloat16``, ``--batches 1,4,16``, ``--policies scissorhands,h2o``);
* ``--dtype`` is the one dtype of a single-dtype tool (``auto`` as in suites), ``--dtypes`` the list a
  side-by-side tool loops over;
* ``--prompt-tokens`` / ``--new-tokens`` are tokens per prompt / generated (decode steps) per request;
* ``--threads`` is torch threads, default 1 in every tool (`THREADS_HELP` says why); a make target that
  measures the whole machine passes its own.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

from replica import cpu_share
from scissorhands.models import cpu_flags, cpu_model_name

REPO_ROOT = Path(__file__).resolve().parents[1]
EMBEDDED_MODEL = "embedded (SmolLM2-135M-Instruct)"
DEFAULT_THREADS = 1
THREADS_HELP = (
    "torch threads; one rule for every bench tool: 1 by default, since side-by-side ratios are "
    "steadiest with one thread on a shared machine (more threads spin-wait on each other); the make targets "
    "that measure the whole machine's ceilings (make roofline, make bench-serving) pass the core count"
)

T = TypeVar("T")


def cpu_conditions() -> str:
    """``model | CPUs | flags: ... | torch | threads: n`` of this machine (the flags that decide the dtype)."""
    import torch

    keep = ("avx512f", "avx512_bf16", "avx2", "avx512_vnni")
    shown = sorted(f for f in cpu_flags() if f.startswith("amx") or f in keep)
    return (
        f"{cpu_model_name()} | {os.cpu_count()} CPUs | flags: {' '.join(shown) or '-'} | torch {torch.__version__} | "
        f"threads: {torch.get_num_threads()}"
    )


def git_commit(*, short: bool = True, fallback: str | None = None) -> str | None:
    """``git rev-parse HEAD`` of this repository (short unless told; ``+dirty`` when tracked files changed), else
    ``$SCISSORHANDS_GIT_COMMIT``, else `fallback` (default ``unknown``)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", *(["--short"] if short else []), "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=20,
        )
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
            return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("SCISSORHANDS_GIT_COMMIT") or (fallback if fallback is not None else "unknown")


def conditions_line(*, model: str, dtype: str | list[str], extra: str = "") -> str:
    """``Conditions: <UTC date>, commit <sha>, model <model>, dtype <dtype>, CPU <cpu_conditions()>[; extra].``

    ``dtype`` says which and why (e.g. ``"bfloat16 (auto: AVX512-BF16 ...)"``); a list is the dtypes a
    side-by-side tool measures each of (``"float32, bfloat16 (--dtypes: each measured)"``). The CPU part carries
    the torch threads in use, so call it after ``torch.set_num_threads``.
    """
    if isinstance(dtype, list):
        dtype = f"{', '.join(dtype)} (--dtypes: each measured)"
    return (
        f"Conditions: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {git_commit()}, "
        f"model {model}, dtype {dtype}, CPU {cpu_conditions()}" + (f"; {extra}" if extra else "") + "."
    )


def require_positive(ap: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Exit 2 (``ap.error``) naming the first of ``names`` (``args`` attributes) below 1, in
    `scissorhands.checks.check_int`'s words: ``--new-tokens: expected an integer >= 1, got 0``."""
    for name in names:
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")


def add_threads(parser: argparse.ArgumentParser) -> None:
    """``--threads`` with the one default rule."""
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)


def parser(
    prog: str, doc: str, run_time: str, where: str = "with the defaults on a 2-core CPU machine"
) -> argparse.ArgumentParser:
    """The parser of a bench tool: the docstring's first paragraph as description, every default shown in
    ``--help``, and ``run_time`` (its expected run time, ``where`` says on what) as the epilog."""
    return argparse.ArgumentParser(
        prog=f"python -m bench.{prog}",
        description=doc.split("\n\n")[0],
        epilog=f"Run time {where}: {run_time}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )


def comma_list(
    ap: argparse.ArgumentParser, flag: str, text: str, cast: Callable[[str], T] = str, valid: tuple | list | None = None
) -> list[T]:
    """``"a,b"`` -> ``[cast("a"), cast("b")]``; exits 2 (``ap.error``) naming ``flag`` for an empty list, an empty
    item, an item ``cast`` refuses, or one outside ``valid``."""
    items = text.split(",")
    if not text or any(not i.strip() for i in items):
        ap.error(
            f"{flag}: expected a comma-separated list without empty items (e.g. "
            f"{','.join(map(str, valid[:2])) if valid else 'a,b'}), got {text!r}"
        )
    out = []
    for item in items:
        try:
            value = cast(item.strip())
        except ValueError:
            ap.error(f"{flag}: {item!r} is not a valid {getattr(cast, '__name__', 'value')}")
        if valid is not None and value not in valid:
            ap.error(f"{flag}: {item!r}; valid: {', '.join(map(str, valid))}")
        out.append(value)
    return out


def contended_lines(tool: str, rows: dict[str, dict]) -> list[str]:
    """The lines a tool's table ends with when some of its rows (``{label: row}``, each with
    `replica.cpu_share` fields) were contended, also said on stderr; none otherwise."""
    lines = cpu_share.contended_lines([{"point_id": label, **row} for label, row in rows.items()])
    for line in lines:
        print(f"{tool}: warning: {line}", file=sys.stderr)
    return ["", *lines] if lines else []
