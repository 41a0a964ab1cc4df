"""Tier 2: every command block of README.md and docs/*.md runs as written (issue 34), so the docs
cannot drift from the code.

The blocks are extracted from the Markdown. A ```` ```bash ```` (or ``sh``/``shell``) block runs
in ``bash -eo pipefail``; any other block runs only when a marker asks for it. Markers are HTML
comments on the lines right before the block's fence (invisible when rendered):

- ``<!-- docs-test: skip REASON -->``: not run, reported as skipped with REASON (a GPU, a real
  cluster or the network; or a block another test already runs, which REASON names);
- ``<!-- docs-test: needs PATH -->``: skipped unless PATH (relative to the repository) exists,
  e.g. the vLLM venv ``make vllm-env`` builds (a build ``make test`` runs beside the tests is
  waited for first);
- ``<!-- docs-test: append PREFIX | TEXT -->``: the short-run override: TEXT (``key=value``
  overrides) is appended to every command of the block that starts with PREFIX, e.g.
  ``append areal launch local | total_train_steps=2``; the rest of the block runs as written;
- ``<!-- docs-test: file PATH -->``: the block is a file a later block uses, written to PATH;
- ``<!-- docs-test: check COMMAND -->``: the block (a YAML) is written to a file and COMMAND runs
  with ``{file}`` replaced by its path, e.g. ``check areal core graph --config {file}``;
- ``<!-- docs-test: cwd PATH -->``: the directory the block runs in (a recipe that ``cd``-ed);
- ``<!-- docs-test: replace OLD | NEW -->``: OLD becomes NEW in the block, ``{free_port}`` a free
  port (a documented port another process may hold).

Blocks run in one scratch directory per module, in file order: ``HOME`` is a scratch ``home/``,
the working directory holds ``examples`` (a link to the repository's) and ``runs/``. The demo's
outputs that recipes build on (``runs/quickstart/model``, its SFT model
``runs/quickstart/sft/run/checkpoints/model/step300``) and ``runs/tiny`` are all the one tiny
model of the test session: ``make demo`` itself is what tests/examples/test_progress.py and
tests/examples/test_interrupt.py run the first stage of.

Cost: about 1.5 minutes on a busy 2-core machine: `areal core sync-ppo` for 2 steps with one
in-process worker (the block's 2 Ray workers are what tests/core/test_sync_ppo.py runs through
the same launcher, so the block's run drops them), `areal eval` on 8 problems (~35 s), `areal
serve` and a chat request (~30 s), four `areal core graph` config checks (~1 s each), and
docs/algorithms.md's rollout-correction overrides loaded onto the demo config (~3 s). The rest
is skipped with its reason: a GPU, a cluster or the network, or a block another test already runs
(docs/recipes.md's reward and workflow recipes: tests/examples/test_recipes.py; the tools demo;
the vLLM GRPO run). Where `make vllm-env` built the vLLM venv, its `vllm bench serve` block adds
~1.5 minutes (vLLM's import).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from areal.utils.network import free_port
from tests import vllm_env

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELLS = ("bash", "sh", "shell")
BLOCK_TIMEOUT = 300  # seconds one block may take
_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!-- docs-test: (\w+)\s*(.*?)\s*-->$")

pytestmark = pytest.mark.slow


@dataclass
class Block:
    """One fenced block: where it is, its language, text and markers."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    markers: list[tuple[str, str]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    def marked(self, kind: str) -> list[str]:
        return [arg for k, arg in self.markers if k == kind]


def extract_blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` with the docs-test markers on the lines before it."""
    lines, blocks, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        markers, k = [], i - 1
        while k >= 0 and (mk := _MARKER.match(lines[k].strip())):
            markers.insert(0, (mk.group(1), mk.group(2)))
            k -= 1
        blocks.append(Block(path, i + 1, m.group(1), "\n".join(lines[i + 1 : end]) + "\n", markers))
        i = end + 1
    return blocks


def apply_appends(text: str, appends: list[str]) -> str:
    """The block with each ``PREFIX | TEXT`` appended to its commands that contain PREFIX
    (backslash-continued lines joined first; before a trailing ``&`` or comment)."""
    joined = re.sub(r"\s*\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        for spec in appends:
            prefix, extra = (s.strip() for s in spec.split("|", 1))
            if prefix in line:
                code, hash_, comment = line.partition("  #")
                code, amp = (
                    (code[:-1].rstrip(), " &")
                    if code.rstrip().endswith("&")
                    else (code.rstrip(), "")
                )
                line = f"{code} {extra}{amp}" + (f"  #{comment}" if hash_ else "")
        out.append(line)
    return "\n".join(out) + "\n"


def runnable(block: Block) -> bool:
    return block.lang in SHELLS or bool(block.marked("file") or block.marked("check"))


BLOCKS = [b for path in DOCS for b in extract_blocks(path) if runnable(b)]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, tiny_model_dir) -> Path:
    """The working directory the blocks share (see the module docstring)."""
    root = tmp_path_factory.mktemp("docs")
    work = root / "work"
    (root / "home").mkdir()
    (work / "runs" / "quickstart" / "sft" / "run" / "checkpoints" / "model").mkdir(parents=True)
    (work / "examples").symlink_to(REPO / "examples")
    (work / ".cache").symlink_to(REPO / ".cache")
    (work / "runs" / "tiny").symlink_to(tiny_model_dir)
    (work / "runs" / "quickstart" / "model").symlink_to(tiny_model_dir)
    (work / "runs" / "quickstart" / "sft" / "run" / "checkpoints" / "model" / "step300").symlink_to(
        tiny_model_dir
    )
    return work


def _env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "AREAL_PROGRESS")}
    env.update(
        HOME=str(work.parent / "home"),
        PATH=f"{REPO / '.venv' / 'bin'}:{env.get('PATH', '')}",
        OMP_NUM_THREADS="1",
    )
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], what: str) -> None:
    """Run ``cmd`` until it exits (not until its output closes: a server the block started in the
    background keeps that open), then kill its process group: what it left running."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        log.seek(0)
        out = log.read().decode(errors="replace")[-4000:]
    assert proc.returncode == 0, (
        f"{what} exited {proc.returncode} (-9: ran past {BLOCK_TIMEOUT} s):\n{out}"
    )


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_doc_block_runs_as_written(block: Block, scratch: Path):
    if reasons := block.marked("skip"):
        pytest.skip(f"{block.name}: {reasons[0]}")
    if any((REPO / p).is_relative_to(vllm_env.VENV) for p in block.marked("needs")):
        vllm_env.wait_built()  # `make test` builds the vLLM venv beside the tests
    missing = [p for p in block.marked("needs") if not (REPO / p).exists()]
    if missing:
        pytest.skip(f"{block.name}: needs {missing[0]} (not built here)")
    env = _env(scratch)
    cwd = Path(block.marked("cwd")[0].replace("~", env["HOME"])) if block.marked("cwd") else scratch
    if files := block.marked("file"):
        target = Path(files[0].replace("~", env["HOME"]))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.text)
        return
    if checks := block.marked("check"):
        config = scratch / f"block-{block.line}.{block.lang or 'txt'}"
        config.write_text(block.text)
        cmd = checks[0].replace("{file}", str(config))
        _run(["bash", "-eo", "pipefail", "-c", cmd], cwd, env, f"{block.name} ({cmd})")
        return
    script = apply_appends(block.text, block.marked("append"))
    for spec in block.marked("replace"):
        old, new = (part.strip() for part in spec.split("|", 1))
        script = script.replace(old, new.replace("{free_port}", str(free_port())))
    _run(["bash", "-eo", "pipefail", "-c", script], cwd, env, f"{block.name}:\n{script}")


def test_apply_appends_extends_only_the_named_commands():
    text = (
        "areal tiny-model --out x\nareal launch local a.py \\\n"
        "    --config c.yaml k=v   # comment\nareal serve &\n"
    )
    got = apply_appends(
        text, ["areal launch local | total_train_steps=2", "areal serve | --port 0"]
    )
    assert got == (
        "areal tiny-model --out x\nareal launch local a.py --config c.yaml k=v "
        "total_train_steps=2  # comment\nareal serve --port 0 &\n"
    )
    assert shlex.split(got.splitlines()[1].split("#")[0])[-1] == "total_train_steps=2"
