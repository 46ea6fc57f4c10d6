"""``python -m distoptim demo``: a tiny run end to end, and bad options / failing ranks as one-line errors."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from distoptim.__main__ import BENCH_SCRIPT
from distoptim.demo.launch import RankContext
from distoptim.demo.options import DemoOptions, parse_options

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 180


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )


def _run_concurrently(*argvs: list[str]) -> list[subprocess.CompletedProcess[str]]:
    procs = [
        subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for argv in argvs
    ]
    done = []
    for argv, proc in zip(argvs, procs):
        out, err = proc.communicate(timeout=TIMEOUT)
        done.append(subprocess.CompletedProcess([sys.executable, *argv], proc.returncode, out, err))
    return done


def _assert_one_line_error(proc: subprocess.CompletedProcess[str], status: int, *needles: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == status, (proc.returncode, proc.stdout, proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_tiny_demo_trains_on_two_ranks() -> None:
    proc = _run("-m", "distoptim", "demo", "--size", "tiny", "--steps", "3", "--world-size", "2", "--batch", "4")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "of unsharded AdamW" in out and "unsharded AdamW holds" in out
    assert "identical on all ranks" in out
    assert "step 3/3" in proc.stderr  # rank 0's progress bar
    # The bar's loss is the summary's: the mean of the ranks' losses (smoothed), so at step 1 they agree.
    bar_first = next(line for line in proc.stderr.splitlines() if "step 1/3" in line).split("loss ")[1].split()[0]
    assert f"first step {bar_first}," in out, (bar_first, out)
    assert "Traceback" not in proc.stderr
    shares = [line.split()[-1] for line in out.splitlines() if line.strip()[:1].isdigit() and line.endswith("%")]
    assert len(shares) == 2 and all(40.0 < float(share.rstrip("%")) < 60.0 for share in shares), out


def test_help_explains_the_demo() -> None:
    proc = _run("-m", "distoptim", "demo", "--help")
    assert proc.returncode == 0
    for needle in ("--world-size", "--steps", "--size", "--text", "--port", "ZeroRedundancyOptimizer"):
        assert needle in proc.stdout


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--world-size", "0"], "--world-size must be at least 1"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--batch", "-2"], "--batch must be at least 1"),
        (["--lr", "0"], "--lr must be positive"),
        (["--size", "huge"], "invalid choice"),
        (["--port", "70000"], "--port must be in"),
        (["--text", "/nonexistent/text"], "does not exist"),
        (["--no-such-option"], "unrecognized arguments"),
    ],
)
def test_bad_options_are_one_line_errors(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_options(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_text_directory_without_python_files_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_options(["--text", str(tmp_path)])
    assert "no *.py files" in capsys.readouterr().err
    small = tmp_path / "small.txt"
    small.write_text("too short")
    with pytest.raises(SystemExit):
        parse_options(["--text", str(small)])
    assert "needs at least" in capsys.readouterr().err


def test_resuming_at_or_past_the_last_step_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint already at --steps leaves nothing to train: a one-line error, not an IndexError in the table."""
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"step": 4, "weight": torch.zeros(2)}, checkpoint_id=tmp_path / "step-4", no_dist=True)
    dcp.save({"weight": torch.zeros(2)}, checkpoint_id=tmp_path / "other", no_dist=True)
    for steps in ("4", "3"):
        with pytest.raises(SystemExit) as exit_info:
            parse_options(["--steps", steps, "--resume", str(tmp_path / "step-4")])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"already at step 4 and --steps is {steps}" in err and "--steps greater than 4" in err, err
    assert parse_options(["--steps", "5", "--resume", str(tmp_path / "step-4")]).resume == str(tmp_path / "step-4")
    with pytest.raises(SystemExit):
        parse_options(["--steps", "5", "--resume", str(tmp_path / "other")])
    assert "not a checkpoint of this demo" in capsys.readouterr().err


def test_busy_port_missing_text_and_unknown_command_from_the_command_line() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        port_proc, text_proc, command_proc = _run_concurrently(
            ["-m", "distoptim", "demo", "--port", str(port)],
            ["-m", "distoptim", "demo", "--text", "/nonexistent/text"],
            ["-m", "distoptim", "frobnicate"],
        )
    _assert_one_line_error(port_proc, 2, f"127.0.0.1:{port} is already in use")
    _assert_one_line_error(text_proc, 2, "does not exist")
    _assert_one_line_error(command_proc, 2, "unknown command")


def failing_rank(ctx: RankContext, options: DemoOptions) -> None:
    """Stands in for the training function: rank 1 raises, rank 0 waits in a collective that never completes."""
    import torch
    import torch.distributed as dist

    if ctx.rank == 1:
        print("noise a failing library might print", file=sys.stderr)
        raise RuntimeError("boom on rank 1\nsecond line of the message")
    dist.all_reduce(torch.ones(1))


def test_failing_rank_ends_in_one_line_and_status_1() -> None:
    code = (
        "import sys; from tests.test_demo import failing_rank; from distoptim.demo.cli import main; "
        "sys.exit(main(['--size', 'tiny', '--world-size', '2'{debug}], rank_fn=failing_rank))"
    )
    quiet, debug = _run_concurrently(["-c", code.format(debug="")], ["-c", code.format(debug=", '--debug'")])
    _assert_one_line_error(quiet, 1, "rank 1 failed: RuntimeError: boom on rank 1", "--debug")
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "boom on rank 1" in debug.stderr.strip().splitlines()[-1]


@pytest.mark.skipif(not BENCH_SCRIPT.is_file(), reason="the benchmark lives in a source checkout")
def test_bench_command_runs_every_variant(tmp_path: Path) -> None:
    """``python -m distoptim bench`` on a toy model: every variant runs; both ZeROs communicate the same bytes."""
    out = tmp_path / "bench.json"
    proc = _run(
        "-m", "distoptim", "bench", "--world-sizes", "2", "--layers", "1", "--width", "32", "--vocab", "64",
        "--seq", "8", "--warmup", "1", "--iters", "2", "--compute-iters", "0", "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    by_name = {result["variant"]: result for result in report["results"]}
    assert set(by_name) == {
        "ddp-adamw",
        "torch-zero",
        "torch-zero-bucket",
        "distoptim-zero",
        "distoptim-zero-bucket",
        "distoptim-overlap",
        "distoptim-overlap-interleaved",
        "distoptim-even-bucket",
        "zero2-greedy-bucket",
        "zero2-even-bucket",
        "zero2-even-interleaved",
        "distoptim-master-bf16",
    }
    grads = 4 * by_name["ddp-adamw"]["num_params"]
    # step()'s all-reduce of 24 int64 (at N=2 it counts once): failed and its negation, six flags (a GradScaler's
    # verdict: found, stepped, waited; a rank joined, a scaler passed or not), a digest and its negation (4 words
    # each), the same for the stepping ranks' part
    agreement = 192
    overlap_agreement = 144  # the overlap hooks agree on what they train, once a backward: 18 int64, no flags
    assert by_name["ddp-adamw"]["comm_bytes_per_rank_per_step"] == pytest.approx(grads)  # 2 (N-1)/N = 1 at N=2
    assert by_name["torch-zero"]["comm_bytes_per_rank_per_step"] == pytest.approx(1.5 * grads)  # + broadcasts
    assert by_name["distoptim-zero"]["comm_bytes_per_rank_per_step"] == pytest.approx(1.5 * grads + agreement)
    for name in ("distoptim-overlap", "distoptim-overlap-interleaved"):
        assert by_name[name]["comm_bytes_per_rank_per_step"] == pytest.approx(1.5 * grads + overlap_agreement)
    # the zero2-* variants run the deprecated reduce_to_owners_hook, an all-reduce now: ZeRO-1's bytes
    for name, extra in [("zero2-greedy-bucket", agreement), ("zero2-even-bucket", agreement)]:
        assert by_name[name]["comm_bytes_per_rank_per_step"] - extra == pytest.approx(1.5 * grads, rel=1e-3)
    interleaved = by_name["zero2-even-interleaved"]["comm_bytes_per_rank_per_step"]
    assert interleaved - overlap_agreement == pytest.approx(1.5 * grads, rel=1e-3)
    bf16 = by_name["distoptim-master-bf16"]["comm_bytes_per_rank_per_step"]  # a bf16 all-reduce and broadcasts
    assert bf16 - agreement == pytest.approx(0.75 * grads, rel=1e-3)  # (even: + padding)
    expected_ratio = (1.5 * grads + agreement) / (1.5 * grads)  # distoptim / torch, both bucket settings
    assert [pair["bytes_ratio"] for pair in report["comparisons"]] == pytest.approx([expected_ratio] * 2)
    assert by_name["distoptim-zero"]["state_bytes_max"] < by_name["ddp-adamw"]["state_bytes_max"]


def test_a_checkpoint_resumes_the_demo_exactly(tmp_path: Path) -> None:
    common = ["-m", "distoptim", "demo", "--size", "tiny", "--steps", "4", "--world-size", "2", "--batch", "4"]
    straight = _run(*common, "--checkpoint", str(tmp_path), "--checkpoint-every", "2")
    assert straight.returncode == 0, straight.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4"]
    resumed = _run(*common, "--resume", str(tmp_path / "step-2"))
    assert resumed.returncode == 0, resumed.stderr

    def checksum(proc: subprocess.CompletedProcess[str]) -> str:
        line = next(line for line in proc.stdout.splitlines() if "identical on all ranks" in line)
        return line.split("checksum ")[1]

    assert "step 3/4" in resumed.stderr and "step 1/4" not in resumed.stderr, "the resumed run starts at step 3"
    _assert_one_line_error(_run(*common, "--resume", str(tmp_path / "step-4")), 2, "already at step 4")
    assert checksum(resumed) == checksum(straight), "2 steps + checkpoint + 2 steps in new processes = 4 steps"
