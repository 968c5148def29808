"""The stop signals of `laionkit train` (SIGTERM, SIGINT, SIGHUP): a checkpoint at a step boundary every rank agrees on."""

from __future__ import annotations

import signal

import torch

from laionkit.trainer.latent_stream import STOP_SIGNALS


class StopFlag:
    """The stop signals (SIGTERM, SIGINT, SIGHUP) turned into a checkpoint at a step boundary that every
    rank agrees on; a second SIGINT stops at once.

    A context manager: handlers are installed by ``install()`` when the loop starts (before it a signal
    keeps its default effect: there is nothing new to save) and the previous ones are restored on exit,
    so a caller training in-process (``laionkit run``, ``laionkit demo``) gets its Ctrl-C back.
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, object] = {}
        self._pending: torch.Tensor | None = None
        self.checkpoint_due = False  # set by agreed(): every rank checkpoints at this step (--checkpoint-minutes)

    def __enter__(self) -> StopFlag:
        return self

    def __exit__(self, *_exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signum

    def agreed(self, accelerator, due: bool = False) -> int | None:
        """Called once per optimizer step on every rank: the signal to stop on now, the same on all ranks;
        ``due`` (a rank's clock says a checkpoint is due: --checkpoint-minutes) rides along, and
        ``checkpoint_due`` is then the value every rank agrees on for this step.

        Ranks get a signal at different moments, so they stop on the max of their flags, all-reduced as
        one element per step. Reading the reduced value at once would make the CPU wait for the GPU
        every step (the loop has no other per-step sync), so the value all-reduced at step N is read at
        step N + 1, after that step's work is queued: by then it is long done, and the stop lands one
        step later than it could. The flag lives on the accelerator's device, as NCCL needs, and is
        filled there by kernels, not copied from the host (a copy would sync too).
        """
        if accelerator.num_processes == 1:
            self.checkpoint_due = due
            return self.signal
        previous = self._pending
        flag = torch.full((2,), float(self.signal or 0), device=accelerator.device)
        flag[1].fill_(float(due))
        self._pending = accelerator.reduce(flag, "max")
        if previous is None:
            self.checkpoint_due = False
            return None
        signal_, due_ = previous.tolist()
        self.checkpoint_due = bool(due_)
        return int(signal_) or None
