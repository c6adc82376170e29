"""What NVML says about a GPU whose trainer exited with a device error (`EXIT_DEVICE`,
worker/trainer/device_fault.py): the evidence the controller puts in the fault record beside
the CUDA error, so an operator can tell a failing GPU from a job's own bug.

From the agent's start to its end NVML stays open, each GPU its trainers may use is
registered for critical Xid events (NVML queues them per event set until they are read,
whenever they happened) and its uncorrectable ECC count is read as a baseline. After a device
error `evidence` drains that GPU's queue and reads again: the Xids since the last ask, the
uncorrectable ECC errors since the agent started, row remapping pending or failed, or that
the GPU is lost. Any of it may be unsupported (ECC off, a container without event access):
what could not be read is named in `unread`, and nothing here ever fails the agent. The agent
never imports torch; NVML needs no CUDA context.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from worker.devices import Gpu

log = logging.getLogger("meshkeeper.devices")


@dataclass
class _Watched:
    uuid: str
    handle: Any
    events: Any  # its NVML event set; None where registration is not supported
    ecc_baseline: int | None
    unread: list[str] = field(default_factory=list)


class DeviceHealth:
    def __init__(self, gpus: list[Gpu]):
        self._nvml: Any = None
        self._watched: dict[int, _Watched] = {}
        if not gpus:
            return
        import pynvml  # nvidia-ml-py; only where there are GPUs (worker/devices.py)

        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            log.warning("NVML unavailable (%s): device errors get no NVML evidence", e)
            return
        self._nvml = pynvml
        for g in gpus:
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(g.uuid)
            except pynvml.NVMLError as e:
                log.warning("NVML cannot open GPU %s (%s)", g.uuid, e)
                continue
            w = _Watched(g.uuid, handle, None, None)
            try:
                events = pynvml.nvmlEventSetCreate()
                pynvml.nvmlDeviceRegisterEvents(
                    handle, pynvml.nvmlEventTypeXidCriticalError, events
                )
                w.events = events
            except pynvml.NVMLError as e:
                w.unread.append(f"xid events ({e})")
            w.ecc_baseline = self._ecc(w)
            self._watched[g.cuda_index] = w

    def evidence(self, cuda_index: int) -> dict[str, Any] | None:
        """NVML's view of `cuda:<cuda_index>` now; None without NVML or that GPU."""
        w = self._watched.get(cuda_index)
        if w is None:
            return None
        pynvml = self._nvml
        out: dict[str, Any] = {"uuid": w.uuid, "xids": self._drain(w)}
        ecc = self._ecc(w)
        if ecc is not None and w.ecc_baseline is not None:
            out["ecc_uncorrected"] = ecc - w.ecc_baseline
        try:
            _, _, pending, failed = pynvml.nvmlDeviceGetRemappedRows(w.handle)
            out["remap_pending"], out["remap_failed"] = bool(pending), bool(failed)
        except pynvml.NVMLError as e:
            if e.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                out["lost"] = True
            else:
                w.unread.append(f"row remapping ({e})")
        if w.unread:
            out["unread"] = sorted(set(w.unread))
        return out

    def close(self) -> None:
        if self._nvml is None:
            return
        for w in self._watched.values():
            if w.events is not None:
                try:
                    self._nvml.nvmlEventSetFree(w.events)
                except self._nvml.NVMLError:
                    pass
        self._nvml.nvmlShutdown()
        self._nvml, self._watched = None, {}

    def _drain(self, w: _Watched) -> list[int]:
        """The critical Xids queued for this GPU since the last drain (a zero wait per event:
        NVML answers Timeout once the queue is empty)."""
        pynvml, xids = self._nvml, []
        while w.events is not None:
            try:
                xids.append(int(pynvml.nvmlEventSetWait_v2(w.events, 0).eventData))
            except pynvml.NVMLError as e:
                if e.value != pynvml.NVML_ERROR_TIMEOUT:
                    w.unread.append(f"xid events ({e})")
                break
        return xids

    def _ecc(self, w: _Watched) -> int | None:
        pynvml = self._nvml
        try:
            return int(
                pynvml.nvmlDeviceGetTotalEccErrors(
                    w.handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                )
            )
        except pynvml.NVMLError as e:
            w.unread.append(f"ECC counts ({e})")
            return None
