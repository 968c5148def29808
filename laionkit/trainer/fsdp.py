"""FSDP2 where accelerate leaves it out: `accelerate launch` with an FSDP config on CPU-only ranks (gloo).

accelerate 1.15 starts the processes of `accelerate launch --config_file train/fsdp.yaml --num_processes 2`
on a machine without GPUs (commands/launch.py sends ``use_fsdp`` to ``multi_gpu_launcher``, which is
torchrun), and the Accelerator builds the FSDP plugin from the launcher's FSDP_* environment, but
``AcceleratorState.__init__`` (state.py, ``elif self.distributed_type in [DistributedType.MULTI_GPU, ...]``)
turns a rank into FSDP only on an accelerator device; a CPU rank stays ``MULTI_CPU`` and the model is
wrapped in DDP: the FSDP config is dropped without a word. torch's FSDP2 (``fully_shard``) itself runs on
CPU over gloo (sharded parameters, bf16 mixed precision, reduce-scatter, distributed checkpoints).

``honor_fsdp_on_cpu`` sets the FSDP state accelerate would have set on a GPU (the same plugin, built from the
same environment), so everything after it is accelerate's own FSDP2 path: ``prepare`` (fsdp2_prepare_model),
``save_state`` / ``load_state`` (sharded distributed checkpoints), ``get_state_dict`` and gradient clipping.
It exists so that the FSDP code paths of `laionkit train` run and are tested with real ranks on CPU; on
GPUs it does nothing.

HSDP (train/hsdp.yaml: FSDP2 plus accelerate's ParallelismConfig, ``dp_shard_size`` ranks of a node sharding,
``dp_replicate_size`` nodes replicating) meets the same gap one step earlier: ``Accelerator.__init__`` validates
the parallelism config against the state it has just made (``ParallelismConfig._validate_accelerator``), and a
``MULTI_CPU`` state is neither FSDP2 nor a "multi device" one, so it raises. ``hold_parallelism_on_cpu`` holds
the config back while the Accelerator is built on CPU ranks; ``honor_fsdp_on_cpu`` then sets it, its device mesh
(on "cpu", over gloo) and validates it once the state is FSDP, as the Accelerator does on GPUs.
"""

from __future__ import annotations

import os

import torch

from laionkit.common import LaionkitError

_PARALLELISM, _HELD = "ACCELERATE_USE_PARALLELISM_CONFIG", "LAIONKIT_HELD_PARALLELISM_CONFIG"


def fsdp_launch() -> bool:
    """Whether accelerate launched this process with an FSDP config."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def hold_parallelism_on_cpu() -> None:
    """Before ``Accelerator(...)``: on a machine without GPUs, hide an FSDP launch's parallelism config (HSDP)
    from the constructor, which would refuse it on CPU ranks; honor_fsdp_on_cpu sets it afterwards."""
    if (not torch.cuda.is_available() and fsdp_launch()
            and os.environ.get(_PARALLELISM, "false").lower() == "true"):
        os.environ.update({_PARALLELISM: "false", _HELD: "true"})


def honor_fsdp_on_cpu(accelerator) -> bool:
    """Make a CPU rank launched with an FSDP config an FSDP2 rank, as a GPU rank would be. Returns whether
    it did (and says so). Called right after the Accelerator is built, before anything is prepared."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    if (accelerator.distributed_type != DistributedType.MULTI_CPU
            or not fsdp_launch()):
        return False
    plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* environment, as Accelerator builds it
    if plugin.fsdp_version != 2:
        raise LaionkitError("FSDP on CPU ranks runs FSDP2 only: set fsdp_version: 2 in the accelerate config "
                            "(train/fsdp.yaml does)")
    if accelerator.mixed_precision == "fp16":
        # the Accelerator made its gradient scaler for the DDP state, not FSDP2's: untried, so refused
        raise LaionkitError("FSDP on CPU ranks: --mixed-precision fp16 is not supported; use bf16 or no")
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):  # --cpu-offload: no GPU to pin host memory for
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    state = accelerator.state
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState.__init__ ends
    if os.environ.pop(_HELD, None) == "true":  # HSDP: held back by hold_parallelism_on_cpu
        os.environ[_PARALLELISM] = "true"
        from accelerate.utils import ParallelismConfig

        config = ParallelismConfig()  # from the launcher's PARALLELISM_CONFIG_* environment
        state.parallelism_config = config
        state.device_mesh = config.get_device_mesh("cpu")
        try:
            config._validate_accelerator(accelerator)
        except ValueError as error:
            raise LaionkitError(f"the accelerate config's parallelism_config: {error}") from None
        accelerator.print(f"HSDP on CPU ranks (gloo): {config.dp_replicate_size} replicas x {config.dp_shard_size} shards")
    else:
        accelerator.print("FSDP2 on CPU ranks (gloo)")
    return True
