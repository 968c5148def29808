"""laionkit.common.cudagraphs.Graphed, the CUDA-graph replay of inference forwards (score --cuda-graphs). CI has no
GPU: there the forward runs as itself; the capture, replay and fallback run on the GPU machine."""

from __future__ import annotations

import torch

from laionkit.common.cudagraphs import Graphed


def test_graphed_forward_runs_eagerly_off_cuda_and_on_cuda_replays_what_eager_gives():
    """laionkit.common.cudagraphs.Graphed: off CUDA it is the forward itself. On CUDA (the GPU machine) a shape
    seen twice is captured and replayed with the eager forward's values, each replay's output its own tensor; a
    forward that cannot be captured (a host sync inside) stays eager with the reason said once."""
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    graphed = Graphed(layer, "test forward")
    x = torch.randn(4, 16)
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(graphed(x), layer(x))
    assert graphed.stats() == {"graphs": 0, "replays": 0}
    if not torch.cuda.is_available():
        return
    layer, said = layer.cuda(), []
    graphed = Graphed(layer, "test forward", log=said.append)
    with torch.inference_mode():
        inputs = [torch.randn(4, 16, device="cuda") for _ in range(4)]
        outputs = [graphed(value) for value in inputs]
        for value, output in zip(inputs, outputs):
            torch.testing.assert_close(output, layer(value))
        assert graphed.stats()["graphs"] == 1 and graphed.stats()["replays"] == 3 and not said
        syncing = Graphed(lambda value: layer(value) * float(value.sum().item() > -1e9), "syncing", log=said.append)
        for value in inputs:
            torch.testing.assert_close(syncing(value), layer(value))
        assert syncing.broken and len(said) == 1 and "capture failed" in said[0]
