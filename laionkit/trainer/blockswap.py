"""`laionkit train --block-swap N`: on one GPU, N of the family's blocks keep their weights in host memory.

The last N blocks of ``FamilySpec.blocks`` are *swapped*. Before a swapped block runs, its weights are on the
GPU; the next swapped block's (in the order the first forward ran them) are copied in on a side CUDA stream
while this one computes (from pinned host memory, so the copy overlaps), and every other swapped block's
weights are dropped from the GPU. Backward walks the blocks in reverse: a hook on a block's outputs fires when
their gradient is ready, i.e. before the block's own backward ops run, and brings its weights back (prefetching
the block before it).
So at any moment at most two swapped blocks are on the GPU (the one computing and the one being copied in),
in forward, in backward and in the forward that activation checkpointing recomputes (it runs after the
block's backward hook has brought the weights in, and the pre-forward hook leaves the current block alone).
Why the order holds: autograd runs ready nodes highest sequence number first, and a block's ops were recorded
in one contiguous stretch, so all of a block's backward ops run before any op of an earlier block.

Two designs, by what trains (the numbers: docs/BENCHMARKS.md and scripts/bench_train_flow.py --block-swap):

* LoRA (``--lora-rank``): the frozen base's weights in the swapped blocks live on the host and never need
  writing back; the adapters, their gradients and their optimizer state stay on the GPU. The model is placed
  so that those weights never reach the GPU at load (``place``), which is what lets a base larger than the
  GPU train. Checkpoints, EMA and the export hold the adapters, on the GPU: unchanged.
* Full fine-tune: between steps every weight is on the GPU (the *rest* state), because the optimizer step,
  gradient clipping, EMA, checkpoints and the export need them there; only during forward and backward do
  the swapped blocks' weights leave. Gradients accumulate on the GPU and the optimizer state stays there;
  at the end of backward all weights come back, and the first eviction after that writes them to the host
  (they changed in the step). Peak memory therefore falls only where activations set it, not where weights
  + gradients + AdamW states do: for those, --cpu-offload or DeepSpeed ZeRO-3 offload.

The swapper takes its ``device`` and ``host`` as arguments: on CPU both are the CPU and the weights still
move between two distinct storages, which is how tests/test_blockswap.py checks it without CUDA.
"""

from __future__ import annotations

import torch

from laionkit.common import LaionkitError


class BlockSwap:
    """The swapped blocks' weights, where each one is, and the hooks that move them.

    Invariant: ``resident`` holds at most two swapped blocks while a step runs (``current`` and the one
    prefetched); ``pending`` maps a block being copied in to the event its copy records."""

    def __init__(self, blocks: list, swapped: int, device: torch.device, host: torch.device, trained: bool):
        self.blocks = list(blocks)
        self.first = len(self.blocks) - swapped  # blocks[first:] swap
        self.device, self.host, self.trained = torch.device(device), torch.device(host), trained
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # per swapped block: the parameters that move (all for a full fine-tune, the frozen ones for LoRA)
        self.params = {index: [p for p in self.blocks[index].parameters() if trained or not p.requires_grad]
                       for index in self.swapped}
        self.stored: dict[int, list[torch.Tensor | None]] = {index: [None] * len(self.params[index])
                                                             for index in self.swapped}
        self.resident: set[int] = set()
        self.dirty: set[int] = set()  # resident blocks whose host copy is stale (a full fine-tune's rest state)
        self.pending: dict[int, object] = {}
        self.current: int | None = None
        # the swapped blocks' order of execution, learned as forward runs (blocks() lists modules in the order
        # they were registered, which is not always the order a forward calls them: a UNet's mid block)
        self.following: dict[int, int] = {}
        self.previous: int | None = None
        self.backward_queued = False

    @property
    def swapped(self) -> range:
        return range(self.first, len(self.blocks))

    # --- moving one block's weights ---

    def _load(self, index: int, ahead: bool) -> None:
        """Copy block ``index``'s weights in: on the side stream when ``ahead`` (a prefetch), else now."""
        stream = self.stream if ahead else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            for slot, param in enumerate(self.params[index]):
                kept = param.data
                if kept.device != self.host:  # moved to the device behind the swap's back (a model.to(device))
                    kept = kept.to(self.host)
                if self.device.type == "cuda" and not kept.is_pinned():
                    kept = kept.pin_memory()  # once: the host copy stays pinned from here on
                self.stored[index][slot] = kept
                param.data = kept.to(self.device, non_blocking=True, copy=True)
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
                self.pending[index] = event
        self.resident.add(index)

    def _ready(self, index: int) -> None:
        """The compute stream waits for a prefetch of ``index``; the copies are marked as used by it, so the
        caching allocator does not hand their memory to the side stream while the compute stream reads."""
        event = self.pending.pop(index, None)
        if event is None:
            return
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(event)
        for param in self.params[index]:
            param.data.record_stream(compute)

    def _evict(self, index: int) -> None:
        """Drop block ``index``'s GPU copies; write them to the host first where they changed."""
        self._ready(index)
        for slot, param in enumerate(self.params[index]):
            kept = self.stored[index][slot]
            if index in self.dirty:
                if kept is None or kept.shape != param.shape or kept.dtype != param.dtype:
                    kept = torch.empty(param.shape, dtype=param.dtype, device=self.host,
                                       pin_memory=self.device.type == "cuda")
                kept.copy_(param.data)
            param.data = kept
            self.stored[index][slot] = None
        self.resident.discard(index)
        self.dirty.discard(index)

    # --- the schedule ---

    def activate(self, index: int, ahead: int | None) -> None:
        """Block ``index`` computes next: its weights present, ``ahead`` (the block after it in this pass)
        copying in, every other swapped block off the device."""
        for other in sorted(self.resident - {index, ahead}):
            self._evict(other)
        if index not in self.resident:
            self._load(index, ahead=False)
        self._ready(index)
        if ahead is not None and ahead not in self.resident:
            self._load(ahead, ahead=True)
        self.current = index

    def rest(self) -> None:
        """Between steps: a full fine-tune has every weight on the device (the step and EMA read them there,
        and may change them: dirty); LoRA leaves the frozen weights where they are."""
        self.current = self.previous = None
        self.backward_queued = False
        if not self.trained:
            return
        for index in self.swapped:
            if index not in self.resident:
                self._load(index, ahead=False)
            self._ready(index)
        self.dirty.update(self.swapped)

    # --- hooks ---

    def install(self) -> None:
        for index in self.swapped:
            self.blocks[index].register_forward_pre_hook(self._before_forward(index))
            self.blocks[index].register_forward_hook(self._after_forward(index))

    def _before_forward(self, index: int):
        def hook(module, args):
            if self.current == index:  # the same block again: checkpointing's recompute inside backward
                return
            if self.previous is not None:
                self.following[self.previous] = index
            self.previous = index
            self.activate(index, self.following.get(index))
        return hook

    def _after_forward(self, index: int):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                for tensor in _tensors(output):
                    if tensor.requires_grad:
                        tensor.register_hook(self._before_backward(index))
            elif index not in self.following:  # a forward without backward ends here
                self.rest()
        return hook

    def _before_backward(self, index: int):
        def hook(grad):
            if not self.backward_queued:  # once per backward pass: rest when it ends
                self.backward_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.rest)
            self.activate(index, next((before for before, after in self.following.items() if after == index), None))
        return hook


def _tensors(output):
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def check_run(config, family, unet, accelerator) -> int:
    """--block-swap N against what the run is: one process, no FSDP / DeepSpeed, N <= the family's blocks.
    Returns the block count."""
    from accelerate.utils import DistributedType

    if accelerator.num_processes > 1 or accelerator.distributed_type != DistributedType.NO:
        raise LaionkitError(f"--block-swap {config.block_swap} moves weights between one GPU and its host: it runs "
                            f"in one process, not under {accelerator.distributed_type.value} with "
                            f"{accelerator.num_processes} ranks (use --cpu-offload or DeepSpeed ZeRO-3 offload there)")
    count = len(family.blocks(unet))
    if config.block_swap > count:
        raise LaionkitError(f"--block-swap {config.block_swap}: this {family.name} {family.denoiser_class} has "
                            f"{count} {'/'.join(family.block_classes)} blocks; give at most {count}")
    return count


def place(unet, config, family, accelerator):
    """``unet.to(device)``, except that under LoRA the swapped blocks' weights stay on the host: a base larger
    than the GPU never has to fit on it. (A full fine-tune rests with every weight on the device.)"""
    device = accelerator.device
    if not config.block_swap or config.lora_rank is None:
        return unet.to(device)
    count = check_run(config, family, unet, accelerator)
    kept = {id(p) for block in family.blocks(unet)[count - config.block_swap:] for p in block.parameters()}
    for module in unet.modules():
        for param in module.parameters(recurse=False):  # a from-scratch base drawn on the GPU leaves it here
            param.data = param.data.to("cpu" if id(param) in kept else device)
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)
    return unet


def attach(unet, config, family, accelerator, host: torch.device | str = "cpu") -> BlockSwap | None:
    """Swap the last --block-swap N blocks of ``unet`` (after LoRA, checkpointing and the dtype policy have
    shaped it, before the optimizer is built): trained parameters still on the host (LoRA adapters that PEFT
    made beside host weights) go to the device, and the hooks are installed. None for N = 0."""
    if not config.block_swap:
        return None
    count = check_run(config, family, unet, accelerator)
    device = accelerator.device
    blocks = family.blocks(unet)
    trained = config.lora_rank is None
    for block in blocks[count - config.block_swap:]:
        for param in block.parameters():
            if param.requires_grad and param.device != device:
                param.data = param.data.to(device)
    swap = BlockSwap(blocks, config.block_swap, device, host, trained)
    if trained:  # at rest on the device; the host copies are allocated at the first eviction
        swap.resident.update(swap.swapped)
        swap.dirty.update(swap.swapped)
    swap.install()
    accelerator.print(f"block swap: {config.block_swap} of {count} {'/'.join(family.block_classes)} blocks' "
                      f"{'weights' if trained else 'frozen weights'} in host memory, one prefetched ahead")
    return swap
