"""`laionkit train`: the trainer as small parts around one loop (``from laionkit.trainer import TrainConfig, run``).

Modules, each importing only the ones above it: config (TrainConfig and its checks: trainchecks, trainfile) →
data (latent sets, stages) → objective (losses, noise, conditioning) → precision (master weights, optimizer;
fp8) → model (builders, FLOPs, FSDP units; lora) → checkpoint (save, verify, resume; runlock, runfolder) →
evaluation (validation images; valloss) → metrics → export (the denoiser; exports: pipelines, single files)
→ loop (setup, train_step, the run), which wires them.
"""

from laionkit.trainer.config import TrainConfig, TrainResult
from laionkit.trainer.loop import run

__all__ = ["TrainConfig", "TrainResult", "run"]
