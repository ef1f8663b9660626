"""GPU telemetry while a capture is armed: NVML samples of the engine's GPUs, as trace records.

The engine-core process drives GPUs it does not open itself (its workers do), so the sampler
reads the devices the engine may use: ``CUDA_VISIBLE_DEVICES`` when set (integer indices), else
every device. Without an NVIDIA driver the sampler says so in ``description`` and samples
nothing; it never raises.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from kvtrace.events import GpuSampled, Record


def visible_gpu_indices(device_count: int) -> list[int]:
    """NVML indices of the GPUs this process may use."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(device_count))
    indices = []
    for item in visible.split(","):
        item = item.strip()
        if item.isdigit() and int(item) < device_count:
            indices.append(int(item))
    return indices


class GpuSampler:
    """Samples memory use and utilisation every ``interval_ms`` on a daemon thread."""

    def __init__(self, emit: Callable[[Record], None], origin_ns: int, interval_ms: int) -> None:
        self.emit = emit
        self.origin_ns = origin_ns
        self.interval_s = max(interval_ms, 10) / 1000 if interval_ms > 0 else 0  # 0: off
        self.description = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.interval_s <= 0:
            self.description = "GPU telemetry off"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in visible_gpu_indices(count)]
        except Exception as error:  # noqa: BLE001 - NVMLError, ImportError: no GPU telemetry
            self.description = f"no GPU telemetry: {error}"
            return
        self.description = f"sampling {len(handles)} GPU(s) every {self.interval_s * 1000:.0f} ms"
        self._thread = threading.Thread(target=self._run, args=(pynvml, handles),
                                        name="kvtrace-gpu", daemon=True)
        self._thread.start()

    def _run(self, pynvml, handles) -> None:
        try:
            while not self._stop.is_set():
                for index, handle in handles:
                    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                    utilization = pynvml.nvmlDeviceGetUtilizationRates(handle)
                    self.emit(GpuSampled(time.time_ns() - self.origin_ns, index, int(memory.used),
                                         int(memory.total), int(utilization.gpu)))
                self._stop.wait(self.interval_s)
        except Exception as error:  # noqa: BLE001
            self.description = f"GPU telemetry stopped: {error}"
        finally:
            try:
                pynvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
