"""The run folder is one run's: a lock (local) or lease (bucket) against a second train, resume rules that
never replace a run silently, the last step always checkpointed, train config files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from conftest import run_cli
from fixtures import metrics

TINY = ("--unet-config", "tiny", "--batch-size", "4", "--lr", "1e-3", "--log-with", "none", "--quiet",
        "--workers", "0", "--log-every", "1")


def _start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "laionkit.cli", *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)


def _wait_for(condition, process: subprocess.Popen) -> None:
    deadline = time.time() + 240
    while not condition():
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.05)


def _logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def test_a_second_train_into_a_running_folder_is_refused_naming_the_holder(latent_shards, tmp_path):
    """Two real processes: while one trains, a second into its --output (resume or overwrite) is refused in
    one line naming the first's pid, and touches nothing; kill -9 of the first frees the folder."""
    run = tmp_path / "run"
    base = ["train", latent_shards, "--output", run, *TINY, "--checkpoint-every", "100000"]
    first = _start([*base, "--max-steps", "100000"])
    try:
        _wait_for(lambda: _logged(run) >= 2, first)
        for extra in (("--resume", "latest"), ("--overwrite",)):
            second = run_cli(*base, "--max-steps", "2", *extra, check=False)
            assert second.returncode == 2, second.stderr[-2000:]
            assert f"is in use by another train (pid {first.pid} on host" in second.stderr
            assert "Traceback" not in second.stderr and len(second.stderr.strip().splitlines()) == 1
        logged = _logged(run)
        _wait_for(lambda: _logged(run) > logged, first)  # the first run trains on, its records whole
        steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(1, len(steps) + 1))
    finally:
        first.kill()
        first.wait()
    # the kernel released the lock of the killed run; it died before its first checkpoint: a preemptible
    # job's --resume latest starts over
    run_cli(*base, "--max-steps", "2", "--resume", "latest")
    assert sorted(metrics(run)) == [1, 2] and (run / "unet" / "config.json").is_file()


def test_resume_latest_never_replaces_a_run_it_cannot_continue(latent_shards, tmp_path):
    run = tmp_path / "run"
    base = ("train", latent_shards, "--output", run, *TINY, "--checkpoint-every", "2")
    run_cli(*base, "--max-steps", "3")
    # the last step is checkpointed though 3 is not a multiple of --checkpoint-every
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    exported = (run / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
    finished = (run / "metrics.jsonl").read_text()

    # --max-steps below the newest checkpoint: refused, not an export of step 3 as if it were step 2
    fewer = run_cli(*base, "--max-steps", "2", "--resume", "latest", check=False)
    assert fewer.returncode == 2 and "step-00000003 is at step 3, past this run's 2 steps" in fewer.stderr, \
        fewer.stderr[-2000:]

    # the checkpoints gone: --resume latest refuses to start over on the finished run
    shutil.rmtree(run / "checkpoints")
    refused = run_cli(*base, "--max-steps", "3", "--resume", "latest", check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "holds a run (its export unet, pipeline) but no complete checkpoint" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert (run / "metrics.jsonl").read_text() == finished
    assert (run / "unet" / "diffusion_pytorch_model.safetensors").read_bytes() == exported

    # --resume latest --overwrite: starts over where there is nothing to resume ...
    run_cli(*base, "--max-steps", "1", "--resume", "latest", "--overwrite")
    assert sorted(metrics(run)) == [1] and [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000001"]
    # ... and resumes where there is
    resumed = run_cli(*base, "--max-steps", "2", "--resume", "latest", "--overwrite")
    assert "resumed from" in resumed.stdout and sorted(metrics(run)) == [1, 2]
    # an explicit checkpoint with --overwrite contradicts itself
    both = run_cli(*base, "--max-steps", "2", "--resume", run / "checkpoints" / "step-00000002", "--overwrite",
                   check=False)
    assert both.returncode == 2 and "--overwrite goes with --resume latest only" in both.stderr

    # a new folder: --resume latest (as a cluster job always passes it) starts fresh
    new = tmp_path / "new"
    run_cli("train", latent_shards, "--output", new, *TINY, "--max-steps", "1", "--resume", "latest")
    assert sorted(metrics(new)) == [1]


def test_a_bucket_run_folder_is_leased_to_one_train(latent_shards, s3):
    """--output s3://: a live lease of another run refuses the train naming its holder; an expired one (its
    run killed on another host) is taken over, renewed while training and deleted at the end."""
    from laionkit.common.runlock import LEASE_NAME, BucketLease
    from laionkit.common.storage import Location

    url = s3.url("runs", "a")
    lease = Location.parse(url) / LEASE_NAME
    train = ("train", latent_shards, "--output", url, *TINY, "--max-steps", "2")
    holder = BucketLease(Location.parse(url), seconds=60)
    holder.acquire()  # as a train running elsewhere holds it
    try:
        refused = run_cli(*train, "--resume", "latest", check=False)
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert "is in use by another train (pid" in refused.stderr and LEASE_NAME in refused.stderr
        assert not (Location.parse(url) / "metrics.jsonl").exists()
    finally:
        holder.release()
    assert not lease.exists()
    # a run killed on another host left its lease: refused until it expires, then taken over
    stale = {"owner": "killed", "pid": 1, "host": "elsewhere", "since": "earlier", "expires": time.time() + 60}
    lease.fs.pipe_file(lease.path, json.dumps(stale).encode())
    assert run_cli(*train, check=False).returncode == 2
    lease.fs.pipe_file(lease.path, json.dumps({**stale, "expires": time.time() - 1}).encode())
    run_cli(*train)
    assert (Location.parse(url) / "unet").is_complete() and not lease.exists()


def test_latents_uploaded_without_done_records_train(latent_shards, s3, tmp_path):
    """A latent folder copied to a bucket by other tools (plain PUTs, as aws s3 sync: no done records)
    counts all its objects (docs/FORMATS.md section 5) and trains."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3.storage_options)
    for path in sorted(p for p in latent_shards.rglob("*") if p.is_file()):
        fs.put_file(str(path), f"{s3.bucket}/latents/{path.relative_to(latent_shards).as_posix()}")
    assert not [name for name in fs.ls(f"{s3.bucket}/latents") if name.endswith(".done")]
    run = tmp_path / "run"
    run_cli("train", s3.url("latents"), "--output", run, *TINY, "--max-steps", "2")
    assert sorted(metrics(run)) == [1, 2] and (run / "unet" / "config.json").is_file()


def test_online_text_refuses_a_text_encoder_replaced_after_encode(flow_latents, image_shards, tmp_path):
    from safetensors.torch import load_file, save_file

    from laionkit.encode import EncodeConfig, run

    model = tmp_path / "model"
    shutil.copytree(flow_latents("sd3").model, model)
    latents = tmp_path / "latents"
    run(EncodeConfig(shards=(str(image_shards / "00000.tar"),), output=latents, model=str(model), resolution=64,
                     batch_size=4, workers=0, quiet=True, text="online"))
    [weights] = (model / "text_encoder_2").glob("*.safetensors")
    save_file({k: v * 2 if v.is_floating_point() else v for k, v in load_file(weights).items()}, weights,
              metadata={"format": "pt"})  # another model under the same name
    base = ("train", latents, "--output", tmp_path / "run", "--transformer", model, *TINY[2:], "--max-steps", "1")
    refused = run_cli(*base, check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"text_encoder_2 from {model} is not the one encode used" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()
    accepted = run_cli(*base, "--allow-changed-text-encoder")
    assert "warning: online-text latents: text_encoder_2" in accepted.stdout + accepted.stderr
    assert sorted(metrics(tmp_path / "run")) == [1]


def test_denoiser_of_another_family_and_guidance_without_embeds_are_refused(flow_latents, tmp_path):
    from laionkit.families import get_family

    sd3 = flow_latents("sd3")
    flux = get_family("flux").write_tiny(tmp_path / "flux", 0)
    base = ("train", sd3.latents, "--output", tmp_path / "run", *TINY[2:], "--max-steps", "1")
    other = run_cli(*base, "--transformer", flux, check=False)
    assert other.returncode == 2, other.stderr[-2000:]
    assert "its config names FluxTransformer2DModel (a flux model); these sd3 latents train a " \
           "SD3Transformer2DModel" in other.stderr and "Traceback" not in other.stderr
    guidance = run_cli(*base, "--transformer", sd3.model, "--train-guidance", "3.5", check=False)
    assert guidance.returncode == 2 and "--train-guidance 3.5: this sd3 SD3Transformer2DModel has no guidance " \
        "embedding" in guidance.stderr, guidance.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_train_config_files_hold_flags_the_command_line_overrides(latent_shards, tmp_path):
    yaml_file, toml_file = tmp_path / "run.yaml", tmp_path / "run.toml"
    yaml_file.write_text(f"latents: {latent_shards}\noutput: {tmp_path / 'a'}\nunet-config: tiny\nmax-steps: 3\n"
                         "batch_size: 2\nlog-with: none\nquiet: true\nworkers: 0\nlog-every: 1\n")
    run_cli("train", "--config", yaml_file, "--max-steps", "1")  # the command line wins
    trainer = json.loads((tmp_path / "a" / "checkpoints" / "step-00000001" / "trainer.json").read_text())
    assert sorted(metrics(tmp_path / "a")) == [1] and trainer["config"]["batch_size"] == 2
    toml_file.write_text('unet_config = "tiny"\nmax_steps = 2\nbatch-size = 2\nlog_with = "none"\nquiet = true\n'
                         'workers = 0\n"--log-every" = 1\n')
    run_cli("train", latent_shards, "--output", tmp_path / "b", "--config", toml_file)
    assert sorted(metrics(tmp_path / "b")) == [1, 2]
    yaml_file.write_text("max-step: 2\n")
    wrong = run_cli("train", latent_shards, "--output", tmp_path / "c", "--config", yaml_file, check=False)
    assert wrong.returncode == 2 and f"--config {yaml_file}: unknown key 'max-step'" in wrong.stderr
