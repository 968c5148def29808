"""`laionkit plan`: each candidate trains in its own `laionkit train` process; the fastest that fits is named."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from laionkit.plan import Candidate, needs_more_memory


def test_plan_measures_each_candidate_and_names_the_fastest(latent_shards, tmp_path):
    output = tmp_path / "plan"
    result = run_cli("plan", latent_shards, "--output", output, "--batch-sizes", "2", "--checkpointing", "auto,none",
                     "--compile", "off", "--steps", 2, "--quiet", "--", "--unet-config", "tiny", "--workers", 0)
    plan = json.loads((output / "plan.json").read_text())
    found = plan["candidates"]
    assert [(c["batch_size"], c["checkpointing"]) for c in found] == [(2, "auto"), (2, "none")]
    for candidate in found:  # samples/s as the candidate's own train run logged it for the measured window
        assert candidate["status"] == "fits", candidate
        metrics = output / "runs" / f"bs{candidate['batch_size']}-{candidate['checkpointing']}-eager" / "metrics.jsonl"
        records = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines())}
        assert candidate["samples_per_s"] == records[4]["samples_per_s"] > 0
        # stopped after the measured window, long before its --max-steps: no checkpoint, no export
        assert not (metrics.parent / "checkpoints").exists() and not (metrics.parent / "unet").exists()
    assert [c["chosen_checkpointing"] for c in found] == ["none", None]  # no CUDA: auto is none
    best = max(found, key=lambda c: c["samples_per_s"])
    assert plan["fastest"] == f"bs{best['batch_size']}-{best['checkpointing']}-eager"
    assert plan["command"].endswith(f"--unet-config tiny --workers 0 --batch-size {best['batch_size']} "
                                    f"--checkpointing {best['checkpointing']}")
    assert f"fastest that fits: {plan['command']}" in result.stdout


@pytest.mark.parametrize(("candidate", "failed", "skipped"), [
    (Candidate(4, "none", False), Candidate(2, "none", False), True),
    (Candidate(2, "none", False), Candidate(2, "every-2", False), True),  # less checkpointing: more memory
    (Candidate(4, "blocks", False), Candidate(2, "none", False), False),  # more checkpointing may fit
    (Candidate(4, "none", True), Candidate(2, "none", False), False),  # compile changes memory either way
    (Candidate(1, "none", False), Candidate(2, "none", False), False),
    (Candidate(4, "auto", False), Candidate(2, "auto", False), True),  # auto could not fit the smaller batch
    (Candidate(4, "auto", False), Candidate(2, "none", False), False),
])
def test_an_out_of_memory_candidate_skips_those_that_need_more(candidate, failed, skipped):
    assert needs_more_memory(candidate, failed) is skipped


def test_plan_refuses_bad_values_in_one_line(latent_shards, tmp_path):
    for flags, message in ((("--batch-sizes", "0,2"), "--batch-sizes '0,2'"), (("--checkpointing", "some"), "--checkpointing 'some'"),
                           (("--compile", "maybe"), "--compile 'maybe'")):
        result = run_cli("plan", latent_shards, "--output", tmp_path / "p", *flags, check=False)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_a_killed_plan_takes_its_candidate_with_it(latent_shards, tmp_path):
    """plan's candidate runs in a session of its own; a SIGKILL of plan must still end it (else it trains
    on towards a --max-steps it never reaches)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    output = tmp_path / "plan"
    plan = subprocess.Popen([sys.executable, "-m", "laionkit.cli", "plan", str(latent_shards), "--output", str(output),
                             "--batch-sizes", "1", "--checkpointing", "none", "--compile", "off", "--steps", "1000",
                             "--quiet", "--", "--unet-config", "tiny", "--workers", "0"])
    deadline, children = time.monotonic() + 120, []
    while not children and time.monotonic() < deadline:  # the candidate's train process has started
        time.sleep(0.5)
        children = subprocess.run(["pgrep", "-f", str(output / "runs")], capture_output=True, text=True).stdout.split()
    assert children, "the candidate never started"
    os.kill(plan.pid, signal.SIGKILL)
    plan.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") and
                                              "Z" not in open(f"/proc/{pid}/stat").read().split()[2] for pid in children):
        time.sleep(0.2)
    alive = [pid for pid in children if os.path.exists(f"/proc/{pid}")
             and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]]
    for pid in alive:  # not left running on failure
        os.kill(int(pid), signal.SIGKILL)
    assert not alive, f"candidate processes outlived the killed plan: {alive}"
