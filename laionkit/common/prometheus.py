"""A Prometheus endpoint for long runs: the numbers a dashboard or an alert needs, scraped over HTTP.

Only rank 0 serves (one scrape target per job); it publishes what it already logs to metrics.jsonl
(the per-rank timings as one series per ``rank`` label, so a dashboard shows a slow node), plus GPU utilisation read through NVML (nvidia-ml-py) when that is installed and a GPU is present.
"""

from __future__ import annotations

from collections.abc import Mapping

from laionkit.common.errors import LaionkitError

# metrics.jsonl key -> (Prometheus name, help)
GAUGES = {
    "step": ("laionkit_train_step", "Optimizer steps done."),
    "loss": ("laionkit_train_loss", "Mean training loss over the last logging window."),
    "lr": ("laionkit_train_learning_rate", "Learning rate."),
    "samples_per_s": ("laionkit_train_samples_per_second", "Samples per second, all ranks together."),
    "samples_per_s_per_gpu": ("laionkit_train_samples_per_second_per_gpu", "Samples per second per GPU."),
    "mfu": ("laionkit_train_mfu", "Model FLOPs utilisation (0-1)."),
    "data_wait_pct": ("laionkit_train_data_wait_percent", "Share of time blocked on the data loader."),
    "gpu_mem_gib": ("laionkit_train_gpu_memory_gib", "Peak GPU memory allocated on rank 0."),
    "straggler_rank": ("laionkit_train_straggler_rank", "The rank with the most forward + data-wait time per step."),
    "straggler_ratio": ("laionkit_train_straggler_ratio",
                        "The straggler's forward + data-wait time over the ranks' median (1: all alike)."),
}
# metrics.jsonl per-rank lists -> (Prometheus name with a `rank` label, help)
RANK_GAUGES = {
    "rank_forward_s": ("laionkit_train_rank_forward_seconds", "Forward-pass seconds per step, per rank."),
    "rank_data_wait_s": ("laionkit_train_rank_data_wait_seconds", "Data-loader wait seconds per step, per rank."),
}


class MetricsServer:
    """Serve gauges on 0.0.0.0:``port``; ``update(record)`` sets them from one metrics.jsonl record."""

    def __init__(self, port: int, gpu_index: int | None = None) -> None:
        try:
            import prometheus_client
        except ImportError:
            raise LaionkitError("--metrics-port needs prometheus-client: pip install 'laionkit[ops]'") from None
        self.registry = prometheus_client.CollectorRegistry()
        self.gauges = {key: prometheus_client.Gauge(name, text, registry=self.registry)
                       for key, (name, text) in GAUGES.items()}
        self.rank_gauges = {key: prometheus_client.Gauge(name, text, ["rank"], registry=self.registry)
                            for key, (name, text) in RANK_GAUGES.items()}
        self.gpu = self._nvml_handle(gpu_index)
        if self.gpu is not None:
            self.utilisation = prometheus_client.Gauge(
                "laionkit_gpu_utilization_percent", "GPU utilisation reported by NVML.", registry=self.registry)
        try:
            self.server, self.thread = prometheus_client.start_http_server(port, registry=self.registry)
        except OSError as error:
            raise LaionkitError(f"--metrics-port {port}: cannot listen ({error.strerror})") from None

    @staticmethod
    def _nvml_handle(gpu_index: int | None):
        if gpu_index is None:
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
            return pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
        except Exception:  # no nvidia-ml-py, no driver: utilisation is simply not exported
            return None

    def update(self, record: Mapping[str, float]) -> None:
        for key, gauge in self.gauges.items():
            if key in record:
                gauge.set(record[key])
        for key, gauge in self.rank_gauges.items():
            for rank, value in enumerate(record.get(key, ())):
                gauge.labels(rank=str(rank)).set(value)
        if self.gpu is not None:
            import pynvml

            self.utilisation.set(pynvml.nvmlDeviceGetUtilizationRates(self.gpu).gpu)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
