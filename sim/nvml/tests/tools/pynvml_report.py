"""What PyPI's pynvml (nvidia-ml-py) reads from libnvidia-ml.so.1, as one JSON object,
for sim/nvml/tests/monitoring_tools.rs to check against the simulator.

Usage: python3 pynvml_report.py HOLDER_PID

Every query goes through pynvml's own wrappers (which find each symbol by name, as
with dlsym, and raise NVMLError_FunctionNotFound for a missing one), except the
sized-array protocol and the v1 process structure, which no pynvml wrapper
exercises, called through pynvml's function pointers with ctypes. An NVML error is
reported as its class name (e.g. "NVMLError_NotSupported") in place of the value.
"""
import ctypes
import json
import sys

import pynvml as N


def query(fn, *args):
    try:
        return fn(*args)
    except N.NVMLError as e:
        return type(e).__name__


def processes(list_fn, handle):
    found = query(list_fn, handle)
    if isinstance(found, str):
        return found
    return [{"pid": p.pid, "used": p.usedGpuMemory} for p in found]


class ProcessInfoV1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


def sized_array_protocol(name, struct, handle):
    """The driver's protocol by hand: ask with 0 room, then with exactly that room."""
    fn = N._nvmlGetFunctionPointer(name)
    count = ctypes.c_uint(0)
    first = fn(handle, ctypes.byref(count), None)
    needed = count.value
    array = (struct * max(needed, 1))()
    second = fn(handle, ctypes.byref(count), array)
    return {
        "first_return": first,
        "needed": needed,
        "second_return": second,
        "entries": [{"pid": array[i].pid, "used": array[i].usedGpuMemory} for i in range(count.value)],
    }


holder_pid = int(sys.argv[1])
N.nvmlInit()
report = {
    "driver_version": N.nvmlSystemGetDriverVersion(),
    "cuda_driver_version": N.nvmlSystemGetCudaDriverVersion(),
    "holder_name": query(N.nvmlSystemGetProcessName, holder_pid),
    "gpus": [],
}
for index in range(N.nvmlDeviceGetCount()):
    h = N.nvmlDeviceGetHandleByIndex(index)
    v1 = N.nvmlDeviceGetMemoryInfo(h)
    v2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
    bad = N.c_nvmlMemory_v2_t()
    bad.version = 1 << 24 | ctypes.sizeof(bad)
    util = N.nvmlDeviceGetUtilizationRates(h)
    clocks = {}
    for name, kind in [("graphics", N.NVML_CLOCK_GRAPHICS), ("sm", N.NVML_CLOCK_SM),
                       ("memory", N.NVML_CLOCK_MEM), ("video", N.NVML_CLOCK_VIDEO)]:
        clocks[name] = [N.nvmlDeviceGetClockInfo(h, kind), N.nvmlDeviceGetMaxClockInfo(h, kind)]
    report["gpus"].append({
        "index": N.nvmlDeviceGetIndex(h),
        "name": N.nvmlDeviceGetName(h),
        "uuid": N.nvmlDeviceGetUUID(h),
        "bus_id": N.nvmlDeviceGetPciInfo(h).busId,
        "memory_v1": {"total": v1.total, "free": v1.free, "used": v1.used},
        "memory_v2": {"version": v2.version, "total": v2.total, "reserved": v2.reserved,
                      "free": v2.free, "used": v2.used},
        "memory_v2_wrong_version": N._nvmlGetFunctionPointer("nvmlDeviceGetMemoryInfo_v2")(h, ctypes.byref(bad)),
        "compute_v3": processes(N.nvmlDeviceGetComputeRunningProcesses, h),
        "compute_v2": processes(N.nvmlDeviceGetComputeRunningProcesses_v2, h),
        "graphics_v3": processes(N.nvmlDeviceGetGraphicsRunningProcesses, h),
        "mps_v3": processes(N.nvmlDeviceGetMPSComputeRunningProcesses, h),
        "compute_v1_by_hand": sized_array_protocol("nvmlDeviceGetComputeRunningProcesses", ProcessInfoV1, h),
        "compute_v3_by_hand": sized_array_protocol("nvmlDeviceGetComputeRunningProcesses_v3",
                                                   N.c_nvmlProcessInfo_v3_t, h),
        "utilization": [util.gpu, util.memory],
        "temperature": query(N.nvmlDeviceGetTemperature, h, N.NVML_TEMPERATURE_GPU),
        "power_usage_mw": query(N.nvmlDeviceGetPowerUsage, h),
        "power_limit_mw": query(N.nvmlDeviceGetEnforcedPowerLimit, h),
        "clocks_mhz": clocks,
        "pcie": [query(N.nvmlDeviceGetCurrPcieLinkGeneration, h), query(N.nvmlDeviceGetCurrPcieLinkWidth, h)],
        "compute_capability": list(N.nvmlDeviceGetCudaComputeCapability(h)),
        "mig_mode": query(N.nvmlDeviceGetMigMode, h),
        "persistence_mode": query(N.nvmlDeviceGetPersistenceMode, h),
        "ecc_uncorrected_volatile": query(N.nvmlDeviceGetTotalEccErrors, h,
                                          N.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, N.NVML_VOLATILE_ECC),
        "fan_speed": query(N.nvmlDeviceGetFanSpeed, h),
        "driver_model": query(N.nvmlDeviceGetDriverModel, h),
    })
N.nvmlShutdown()
print(json.dumps(report))
