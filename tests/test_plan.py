"""`laionkit plan`: each candidate trains in its own `laionkit train` process; the fastest that fits is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from laionkit.plan import Candidate, PlanConfig, Strategy, candidates, ladder, needs_more_memory, skip_reason


def test_plan_measures_each_candidate_and_names_the_fastest(latent_shards, tmp_path):
    """Also: --gpu-memory-gib reaches each candidate (ignored without CUDA, said so); `train --plan` starts
    the fastest and the run keeps the plan."""
    output = tmp_path / "plan"
    result = run_cli("plan", latent_shards, "--output", output, "--batch-sizes", "2", "--checkpointing", "auto,none",
                     "--compile", "off", "--gpu-memory-gib", "24", "--steps", 2, "--quiet", "--",
                     "--unet-config", "tiny", "--workers", 0)
    plan = json.loads((output / "plan.json").read_text())
    found = plan["candidates"]
    assert [(c["batch_size"], c["checkpointing"], c["status"]) for c in found] == [(2, "auto", "fits"),
                                                                                (2, "none", "fits")]
    fitting = found
    for candidate in fitting:  # samples/s as the candidate's own train run logged it for the measured window
        metrics = output / "runs" / f"bs{candidate['batch_size']}-{candidate['checkpointing']}-eager" / "metrics.jsonl"
        records = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines())}
        assert candidate["samples_per_s"] == records[4]["samples_per_s"] > 0
        # stopped after the measured window, long before its --max-steps: no checkpoint, no export
        assert not (metrics.parent / "checkpoints").exists() and not (metrics.parent / "unet").exists()
        log = (output / "logs" / f"bs2-{candidate['checkpointing']}-eager.log").read_text()
        assert "--gpu-memory-gib 24: no CUDA device, nothing to cap (ignored)" in log
    assert [c["chosen_checkpointing"] for c in fitting] == ["none", None]  # no CUDA: auto is none
    best = max(fitting, key=lambda c: c["samples_per_s"])
    assert plan["fastest"] == f"bs{best['batch_size']}-{best['checkpointing']}-eager"
    assert plan["command"].endswith(f"--unet-config tiny --workers 0 --batch-size {best['batch_size']} "
                                    f"--checkpointing {best['checkpointing']}")
    assert f"fastest that fits: {plan['command']}" in result.stdout

    run = tmp_path / "run"
    run_cli("train", "--plan", output / "plan.json", "--output", run, "--max-steps", 1, "--batch-size", 1,
            "--log-with", "none", "--export", "none", "--quiet")
    assert json.loads((run / "plan.json").read_text()) == plan  # the run keeps the plan it came from
    record = json.loads(next((run / "checkpoints").glob("*/trainer.json")).read_text())["config"]
    assert (record["latents"], record["unet_config"], record["workers"]) == (str(latent_shards), "tiny", 0)
    assert (record["batch_size"], record["checkpointing"], record["plan"]) == (1, best["checkpointing"],
                                                                               str(output / "plan.json"))


def test_a_strategy_that_fails_is_recorded_and_not_tried_again(latent_shards, tmp_path):
    """--base-dtype quantizes a LoRA run's base: without --lora-rank train refuses it. plan records the
    failure, skips the larger batch with the same flags, and says that nothing fits (not a traceback)."""
    output = tmp_path / "plan"
    result = run_cli("plan", latent_shards, "--output", output, "--batch-sizes", "1,2", "--checkpointing", "none",
                     "--compile", "off", "--base-dtypes", "nf4", "--steps", 1, "--quiet", "--", "--unet-config",
                     "tiny", "--workers", 0, check=False)
    found = json.loads((output / "plan.json").read_text())["candidates"]
    assert [(c["batch_size"], c["status"]) for c in found] == [(1, "failed"), (2, "skipped")]
    assert "--base-dtype" in found[0]["detail"] and found[1]["detail"] == "bs1-none-eager-base-nf4 failed"
    assert result.returncode == 2 and "plan: no candidate fits" in result.stderr and "Traceback" not in result.stderr


def test_train_refuses_an_unreadable_plan_in_one_line(tmp_path):
    broken = tmp_path / "plan.json"
    broken.write_text(json.dumps({"latents": "x", "train_args": [], "train_flags": None}))
    for path, message in ((tmp_path / "none.json", "no such file"), (broken, "not a plan.json")):
        result = run_cli("train", "--plan", path, "--output", tmp_path / "run", "--max-steps", 1, check=False)
        assert result.returncode == 2 and f"--plan {path}" in result.stderr and message in result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    result = run_cli("train", tmp_path, "--output", tmp_path / "run", "--unet-config", "tiny", "--max-steps", 1,
                     "--gpu-memory-gib", 0, check=False)
    assert result.returncode == 2 and "--gpu-memory-gib 0.0: a number of GiB > 0" in result.stderr


@pytest.mark.parametrize(("dtypes", "swaps", "offload", "expected"), [
    (("bf16",), (0,), False, [Strategy()]),
    (("nf4", "bf16", "fp8"), (0,), False, [Strategy(), Strategy("fp8"), Strategy("nf4")]),  # least saving first
    (("bf16", "nf4"), (16, 0, 8), True, [Strategy(), Strategy("nf4"), Strategy("nf4", 8), Strategy("nf4", 16),
                                         Strategy("nf4", cpu_offload=True)]),
    (("bf16",), (8,), False, [Strategy(block_swap=8)]),  # no 0: every rung swaps
])
def test_the_memory_ladder_climbs_from_least_to_most_saving(dtypes, swaps, offload, expected):
    assert ladder(dtypes, swaps, offload) == expected


NF4, SWAP = Strategy("nf4"), Strategy("nf4", 8)


@pytest.mark.parametrize(("candidate", "done", "reason"), [
    (Candidate(2, "none", False, strategy=NF4, rung=1), [Candidate(2, "blocks", False, status="fits")],
     "bs2-blocks-eager fits with less memory saved"),  # a lower rung fits this batch: no need to climb
    (Candidate(2, "none", False, strategy=NF4, rung=1), [Candidate(2, "none", False, status="out of memory")], None),
    (Candidate(4, "none", False, strategy=NF4, rung=1), [Candidate(2, "none", False, status="fits")], None),
    (Candidate(2, "none", False, True, NF4, 1), [Candidate(2, "none", False, status="fits")], None),  # --fp8 differs
    (Candidate(4, "none", False, strategy=NF4, rung=1),  # the same rung ran out of memory at a smaller batch
     [Candidate(2, "none", False, strategy=NF4, rung=1, status="out of memory")], "bs2-none-eager-base-nf4 ran out of memory"),
    (Candidate(4, "none", False, strategy=SWAP, rung=2),
     [Candidate(2, "none", False, strategy=NF4, rung=1, status="out of memory")], None),  # a higher rung may fit
    (Candidate(4, "none", False, strategy=SWAP, rung=2),  # its flags failed once: they fail again
     [Candidate(1, "blocks", True, strategy=SWAP, rung=2, status="failed")], "bs1-blocks-compiled-base-nf4-swap8 failed"),
    (Candidate(4, "none", False, True, SWAP, 2), [Candidate(1, "none", False, True, status="failed")],
     "bs1-none-eager-fp8 failed"),
    (Candidate(4, "none", False, strategy=SWAP, rung=2), [Candidate(1, "none", False, True, status="failed")], None),
    (Candidate(2, "auto", False), [Candidate(2, "none", False, status="fits")], "bs2-none-eager fits: auto is none there"),
])
def test_skip_reason(candidate, done, reason):
    assert skip_reason(candidate, done) == reason


@pytest.mark.parametrize(("fits", "measured"), [
    # the plain bf16 base fits every batch: no strategy is tried
    (lambda c: True, ["bs1-none-eager", "bs2-none-eager", "bs4-none-eager"]),
    # bf16 fits nothing, nf4 up to batch 2, swapping 8 blocks batch 4
    (lambda c: c.rung == 1 and c.batch_size <= 2 or c.rung == 2,
     ["bs1-none-eager", "bs1-none-eager-base-nf4", "bs2-none-eager-base-nf4", "bs4-none-eager-base-nf4",
      "bs4-none-eager-base-nf4-swap8"]),
    # nothing fits: each rung runs out once, at batch 1, and CPU offload is tried last
    (lambda c: False, ["bs1-none-eager", "bs1-none-eager-base-nf4", "bs1-none-eager-base-nf4-swap8",
                       "bs1-none-eager-base-nf4-offload"]),
])
def test_the_search_climbs_the_ladder_only_where_the_rungs_below_ran_out_of_memory(fits, measured):
    """candidates' order with skip_reason, each measured candidate's outcome given by ``fits``."""
    config = PlanConfig(latents=".", output=Path("."), batch_sizes=(4, 1, 2), checkpointing=("none",),
                        compile=(False,), base_dtypes=("bf16", "nf4"), block_swaps=(0, 8), cpu_offload=True)
    found = candidates(config)
    for done, candidate in enumerate(found):
        if skip_reason(candidate, found[:done]) is None:
            candidate.status = "fits" if fits(candidate) else "out of memory"
    assert [c.name for c in found if c.status != "pending"] == measured


def test_cpu_offload_leaves_auto_out_and_launches_fsdp(tmp_path):
    from laionkit.plan import train_argv

    config = PlanConfig(latents="latents", output=tmp_path, batch_sizes=(1,), checkpointing=("auto", "none"),
                        compile=(False,), block_swaps=(0,), cpu_offload=True, gpu_memory_gib=24)
    found = candidates(config)
    assert [c.name for c in found] == ["bs1-auto-eager", "bs1-none-eager", "bs1-none-eager-offload"]
    argv = train_argv(config, found[-1], tmp_path / "run")
    assert argv[1:4] == ["-m", "accelerate.commands.launch", "--config_file"] and Path(argv[4]).is_file()
    assert argv[argv.index("--cpu-offload") + 1:argv.index("--cpu-offload") + 3] == ["--gpu-memory-gib", "24"]


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
                           (("--compile", "maybe"), "--compile 'maybe'"), (("--fp8", "yes"), "--fp8 'yes'"),
                           (("--base-dtypes", "bf16,fp4"), "--base-dtypes 'bf16,fp4'"),
                           (("--block-swaps", "0,-8"), "--block-swaps '0,-8'")):
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
