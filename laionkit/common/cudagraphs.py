"""Inference forwards replayed from CUDA graphs, for loops whose host cannot launch kernels as fast as the device
runs them.

A ViT-L/14 forward is ~700 kernel launches, each tens of microseconds of Python and dispatch on the thread that
also feeds the loop; on a host whose cores are busy decoding, that thread, not the device, can bound the stage.
A CUDA graph replays the whole forward with one launch (torch.cuda.graph, captured as PyTorch's "whole network
capture" recipe does: warm-up on a side stream, static input and output tensors).

``Graphed(fn)`` wraps a forward of tensors: a shape seen ``after`` times is captured (so the odd shapes, a shard's
last partial batch, stay eager), checked against the eager output of the same input, and replayed from then on;
its output is cloned off the graph's static buffer, so a caller may queue the next replay before it reads this one.
A capture that fails, or whose replay differs from eager, turns the wrapper eager for good and says why once
(``broken``). Off CUDA it calls ``fn``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Graphed:
    """``fn(*tensors) -> tensor`` replayed from a CUDA graph per input shape (module docstring)."""

    def __init__(self, fn: Callable[..., torch.Tensor], name: str, after: int = 2,
                 log: Callable[[str], None] = lambda _: None) -> None:
        self.fn = fn
        self.name = name
        self.after = after
        self.log = log
        self.seen: dict[tuple, int] = {}
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor]] = {}
        self.broken: str | None = None
        self.replays = 0

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.broken is not None or inputs[0].device.type != "cuda":
            return self.fn(*inputs)
        key = tuple((tuple(x.shape), x.dtype, x.stride()) for x in inputs)
        if key not in self.graphs:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] < self.after:
                return self.fn(*inputs)
            try:
                captured = self._capture(inputs)
            except Exception as error:  # noqa: BLE001 - a forward that cannot be captured runs eagerly
                self._break(f"its capture failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
                return self.fn(*inputs)
            if self.broken is not None:  # replayed, but not as eager computes it
                return self.fn(*inputs)
            self.graphs[key] = captured
        graph, static_inputs, static_output = self.graphs[key]
        for static, given in zip(static_inputs, inputs):
            static.copy_(given, non_blocking=True)
        graph.replay()
        self.replays += 1
        return static_output.clone()

    def _capture(self, inputs) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor]:
        static_inputs = [x.clone() for x in inputs]  # clone keeps the memory format (channels_last stays so)
        side = torch.cuda.Stream(device=inputs[0].device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: lazy inits, cuBLAS workspaces, autotuning
            for _ in range(2):
                expected = self.fn(*static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the loop's other threads (a pixel thread, the loader's pin thread) go on using CUDA
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            static_output = self.fn(*static_inputs)
        graph.replay()
        if static_output.shape != expected.shape or not torch.allclose(static_output.float(), expected.float(),
                                                                      rtol=1e-3, atol=1e-3):
            self._break("its replay differs from the eager forward")
        return graph, static_inputs, static_output

    def _break(self, why: str) -> None:
        self.broken = why
        self.graphs.clear()
        self.log(f"laionkit: {self.name} runs without CUDA graphs: {why}")

    def stats(self) -> dict:
        return {"graphs": len(self.graphs), "replays": self.replays, **({"broken": self.broken} if self.broken else {})}
