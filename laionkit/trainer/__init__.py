"""`laionkit train`: the trainer as small parts around one loop (``from laionkit.trainer import TrainConfig, run``).

Modules, each importing only ones listed before it (tests/test_imports.py): config (TrainConfig; the flag
checks in trainchecks, --config files in trainfile) → data (latent sets, stages; the stream: latent_order, latent_stream) → objective (losses,
noise, conditioning) → precision (master weights, optimizer; fp8) → model (builders, FLOPs, FSDP units;
fsdp, lora) → checkpoint (save, verify, resume; runfolder) → evaluation (validation images;
valloss) → metrics → export (the denoiser, after_training, `laionkit export`; pipeline_folder, singlefile) →
signals (stop signals) → memory (--checkpointing auto: measured on the built trainer) → evalhook (--eval-every: the exported weights
scored as `laionkit eval` scores them) → loop (setup, train_step, the run), which wires them.
"""

from laionkit.trainer.config import TrainConfig, TrainResult

__all__ = ["TrainConfig", "TrainResult", "run"]


def __getattr__(name: str):
    """``run`` on first use: the loop imports torch, and the CLI builds `laionkit train` from TrainConfig alone."""
    if name == "run":
        from laionkit.trainer.loop import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
