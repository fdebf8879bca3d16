"""benchmarks/engine_host.py: the engine's host work per step with the device stubbed out, against another
revision of the package in the same run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "benchmarks/engine_host.py", *args, "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("modes,against", [("sync,async,streamed", []), ("streamed", ["--against", "HEAD"])])
def test_each_mode_generates_every_requested_token_in_each_tree_and_the_phases_add_up(modes, against, tmp_path):
    done = run(["--requests", "3", "--rounds", "1", "--modes", modes, *against], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    r = json.loads((tmp_path / "engine_host.json").read_text())
    assert list(r["modes"]) == modes.split(",")
    for by_tree in r["modes"].values():
        assert set(by_tree) == {"this tree", *against[1:]}
        for m in by_tree.values():
            # ignore_eos: the stubbed engine ran every request to its max_tokens
            assert m["output_tokens"] == m["requested_tokens"] > 0 and m["steps"] > 0
            assert sum(m["phases"].values()) == pytest.approx(m["seconds"])
            assert min(m["phases"].values()) >= 0
    assert (tmp_path / "engine_host.png").exists() and ("speed-up" in done.stdout) == bool(against)
    # the worktree of the other revision is gone
    listed = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    assert "nanoforge-against-" not in listed


@pytest.mark.parametrize("args,line", [
    (["--rounds", "0"], "--requests and --rounds must be positive"),
    (["--against", "no-such-revision"], "--against no-such-revision:"),
    (["--modes", "sync,fast"], "--modes takes a comma-separated list of sync, async, streamed"),
])
def test_bad_arguments_are_one_line(args, line, tmp_path):
    done = run(args, tmp_path)
    assert done.returncode == 2 and done.stderr.strip().startswith(line) and len(done.stderr.strip().splitlines()) == 1
