"""Tier 1: the launcher's console (children's lines and progress redraws) and the trainer's
step progress (a bar on a terminal, plain lines in logs)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time

from areal.api.launch import LaunchEnv
from areal.launcher.console import ERASE_LINE, Console, split_output
from areal.launcher.procs import LogPump
from areal.utils.progress import StepProgress, format_seconds


def test_split_output_keeps_what_a_terminal_shows():
    items, rest = split_output(b"loading\nsteps 1/9\rsteps 2/9\rsteps 3/9")
    assert items == [("line", b"loading"), ("redraw", b"steps 3/9")]
    assert rest == b"\rsteps 3/9"  # a frame may go on in the next read
    items, rest = split_output(rest + b"\rsteps 9/9\n")  # tqdm's close: the last frame, then \n
    assert items == [("line", b"steps 9/9")] and rest == b""
    assert split_output(b"crlf line\r\n")[0] == [("line", b"crlf line")]
    assert split_output(b"partial")[0] == [] and split_output(b"partial")[1] == b"partial"


def test_console_redraws_a_bar_on_a_terminal_and_keeps_it_below_log_lines():
    out = io.StringIO()
    console = Console(out, tty=True)
    console.redraw("trainer", "steps 2/9")
    console.line("server0", "GET /health 200")
    console.redraw("trainer", "steps 3/9")
    console.line("trainer", "steps 9/9")  # the bar's last frame ends as a line
    assert out.getvalue() == (
        f"{ERASE_LINE}[trainer] steps 2/9"
        f"{ERASE_LINE}[server0] GET /health 200\n[trainer] steps 2/9"
        f"{ERASE_LINE}[trainer] steps 3/9"
        f"{ERASE_LINE}[trainer] steps 9/9\n"
    )


def test_console_drops_redraws_when_not_a_terminal():
    out = io.StringIO()
    console = Console(out, tty=False)
    console.redraw("trainer", "steps 2/9")
    console.line("trainer", "done")
    assert out.getvalue() == "[trainer] done\n"


def test_log_pump_echoes_a_progress_frame_before_its_line_ends():
    """A child that redraws with \\r and sleeps: the frame reaches the console while the child
    still runs (it used to wait for the newline at the end of the stage)."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "sys.stderr.write('\\rsteps 1/2'); sys.stderr.flush(); time.sleep(5)\n"
            "sys.stderr.write('\\rsteps 2/2\\n')",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out, log = io.StringIO(), io.BytesIO()
    log.close = lambda: None  # keep it readable
    pump = LogPump(child.stdout, log, "trainer", Console(out, tty=True))
    pump.start()
    deadline = time.monotonic() + 4
    while "steps 1/2" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "[trainer] steps 1/2" in out.getvalue() and child.poll() is None
    child.wait(timeout=30)
    pump.join(timeout=5)
    assert out.getvalue().endswith("[trainer] steps 2/2\n")
    assert list(pump.recent) == ["steps 2/2"]
    assert log.getvalue() == b"\rsteps 1/2\rsteps 2/2\n"  # the log keeps the raw output


def test_step_progress_prints_plain_lines_every_n_steps_with_rate_and_eta():
    out = io.StringIO()
    progress = StepProgress(total=40, initial=0, mode="lines", out=out, interval=1e9)
    for _ in range(40):
        progress.update()
    lines = out.getvalue().splitlines()
    # step 1, then every 40 // 20 = 2 steps: 1, 2, 4, ..., 40
    assert [line.split()[1] for line in lines] == ["1/40"] + [f"{s}/40" for s in range(2, 41, 2)]
    assert "steps/s | ETA" in lines[0] and lines[-1].startswith("steps 40/40 (100%)")


def test_step_progress_resumed_run_counts_from_its_start_step():
    out = io.StringIO()
    progress = StepProgress(total=100, initial=60, mode="lines", out=out, interval=1e9)
    progress.update()
    assert out.getvalue().startswith("steps 61/100 (61%)")


def test_step_progress_first_line_rate_counts_the_first_steps_time():
    out = io.StringIO()
    # the first step began 2 s ago: 1 step / 2 s = 0.50 steps/s (it used to count from the
    # first update, ~1e-5 s, and print ~100,000 steps/s)
    start = time.monotonic() - 2.0
    progress = StepProgress(total=10, initial=0, mode="lines", out=out, interval=1e9, start=start)
    progress.update()
    rate = float(re.search(r"\| ([\d.]+) steps/s", out.getvalue()).group(1))
    assert 0.4 <= rate <= 0.5


def test_step_progress_shows_the_latest_headline_figures_and_ends_with_a_summary():
    out = io.StringIO()
    progress = StepProgress(total=2, initial=0, mode="lines", out=out, interval=1e9)
    progress.update({"reward/mean": 0.25, "staleness/mean": 0.5, "timing/step": 3.0})
    progress.update({"reward/mean": 0.75, "eval/accuracy": 0.125})  # staleness kept from step 1
    progress.close()
    first, second, summary = out.getvalue().splitlines()
    assert first.endswith("| reward 0.25 | staleness 0.5")
    assert second.endswith("| reward 0.75 | eval 0.125 | staleness 0.5")
    assert re.fullmatch(
        r"done: 2 steps in \d+s \| reward 0.75 \| eval 0.125 \| staleness 0.5", summary
    )


def test_progress_mode_follows_the_launcher_then_the_terminal():
    assert LaunchEnv.read({"AREAL_PROGRESS": "bar"}).progress_mode(stderr_is_tty=False) == "bar"
    assert LaunchEnv.read({"AREAL_PROGRESS": "lines"}).progress_mode(stderr_is_tty=True) == "lines"
    assert LaunchEnv.read({}).progress_mode(stderr_is_tty=True) == "bar"
    assert LaunchEnv.read({}).progress_mode(stderr_is_tty=False) == "lines"


def test_format_seconds():
    assert [format_seconds(s) for s in (12, 124, 3720)] == ["12s", "2m04s", "1h02m"]


def test_thread_split_shares_the_usable_cores_among_the_processes_of_the_machine():
    from areal.launcher.common import thread_split

    server, trainer, line = thread_split(0, 0, n_servers=1, n_trainers=1, cores=2)
    assert (server, trainer) == (1, 1) and "2 usable cores" in line and "even share" in line
    assert thread_split(0, 0, n_servers=0, n_trainers=1, cores=8)[:2] == (8, 8)
    assert thread_split(0, 0, n_servers=4, n_trainers=4, cores=2)[:2] == (1, 1)  # never 0
    server, trainer, line = thread_split(3, 0, n_servers=1, n_trainers=1, cores=8)
    assert (server, trainer) == (3, 4) and "3 (launcher.server_threads)" in line


def test_dataloader_start_raises_no_deprecation_warning(tiny_tokenizer):
    import warnings

    from areal.api.config.data import DatasetConfig
    from areal.dataset import create_dataloader, load_dataset

    cfg = DatasetConfig(type="rl", path="arithmetic", batch_size=4)
    dataset = load_dataset(cfg, tiny_tokenizer, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        create_dataloader(dataset, cfg, seed=0)
    assert not [str(w.message) for w in caught if "set_vital" in str(w.message)]


def test_what_children_print_while_they_are_stopped_stays_in_their_logs(tmp_path):
    """Teardown output (torchrun's SignalException traceback, vLLM's nanobind leak report) is
    not echoed; what a child printed before it is, and the log keeps both."""
    from areal.launcher.procs import ProcessSupervisor

    code = (
        "import signal, sys, time\n"
        "def bye(*_):\n    print('nanobind: leaked 3 instances!', flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\nprint('serving', flush=True)\ntime.sleep(60)\n"
    )
    out = io.StringIO()
    sup = ProcessSupervisor(tmp_path, echo=True, stop_timeout=10)
    sup.console = Console(out, tty=False)
    child = sup.start("server0", [sys.executable, "-c", code])
    deadline = time.monotonic() + 30
    while "serving" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    sup.stop_all()
    assert out.getvalue() == "[server0] serving\n"
    assert "nanobind: leaked" in child.log_path.read_text()
