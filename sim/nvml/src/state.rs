//! The library's state: the simulated machine it reports on (opened once, on the
//! first `nvmlInit*`, from the process's `KIWI_SIM_*` knobs), the init reference
//! count `nvmlShutdown` decrements, and the mapping between device handles and GPU
//! indices, which refuses handles of a GPU that `kiwi-sim fault --lost` took away.

use std::ffi::c_uint;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

use kiwi_sim_core::{GpuUsage, Machine, SimConfig};

use crate::abi::*;
use crate::ffi::out;

pub(crate) struct State {
    pub machine: Machine,
    /// The machine's name (`KIWI_SIM_NAME`): GPU UUIDs derive from it.
    pub name: String,
}

static STATE: OnceLock<Result<State, NvmlReturn>> = OnceLock::new();
static INIT_COUNT: AtomicU32 = AtomicU32::new(0);

/// `nvmlInit*`: opens the machine on the first call; every successful call counts.
pub(crate) fn init() -> Result<(), NvmlReturn> {
    let r = STATE.get_or_init(|| {
        let cfg = SimConfig::from_env().map_err(|e| {
            eprintln!("kiwi-sim libnvidia-ml: {e}");
            NVML_ERROR_DRIVER_NOT_LOADED
        })?;
        let machine = Machine::open(&cfg).map_err(|e| {
            eprintln!("kiwi-sim libnvidia-ml: {e}");
            NVML_ERROR_DRIVER_NOT_LOADED
        })?;
        Ok(State {
            machine,
            name: cfg.name,
        })
    });
    match r {
        Ok(_) => {
            INIT_COUNT.fetch_add(1, Ordering::AcqRel);
            Ok(())
        }
        Err(e) => Err(*e),
    }
}

/// `nvmlShutdown`: one init fewer; `NVML_ERROR_UNINITIALIZED` when there was none.
pub(crate) fn shutdown() -> Result<(), NvmlReturn> {
    INIT_COUNT
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
        .map(|_| ())
        .map_err(|_| NVML_ERROR_UNINITIALIZED)
}

/// The state, or `NVML_ERROR_UNINITIALIZED` outside `nvmlInit` .. `nvmlShutdown`.
pub(crate) fn state() -> Result<&'static State, NvmlReturn> {
    if INIT_COUNT.load(Ordering::Acquire) == 0 {
        return Err(NVML_ERROR_UNINITIALIZED);
    }
    match STATE.get() {
        Some(Ok(s)) => Ok(s),
        Some(Err(e)) => Err(*e),
        None => Err(NVML_ERROR_UNINITIALIZED),
    }
}

/// A GPU a handle names, checked: the machine has it and it is not lost.
#[derive(Clone, Copy)]
pub(crate) struct Gpu {
    pub state: &'static State,
    pub index: u32,
}

impl Gpu {
    /// The GPU of `handle`: `NVML_ERROR_INVALID_ARGUMENT` for a handle that names
    /// none, `NVML_ERROR_GPU_IS_LOST` for a lost one.
    pub(crate) fn of(handle: Device) -> Result<Gpu, NvmlReturn> {
        let state = state()?;
        let index = handle.checked_sub(1).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        let index = u32::try_from(index).map_err(|_| NVML_ERROR_INVALID_ARGUMENT)?;
        Gpu::at(state, index, NVML_ERROR_INVALID_ARGUMENT)
    }

    /// GPU `index`; `missing` when the machine has no such GPU.
    pub(crate) fn at(
        state: &'static State,
        index: u32,
        missing: NvmlReturn,
    ) -> Result<Gpu, NvmlReturn> {
        if index >= state.machine.gpu_count() {
            return Err(missing);
        }
        if state.machine.fault(index).map(|f| f.lost).unwrap_or(false) {
            return Err(NVML_ERROR_GPU_IS_LOST);
        }
        Ok(Gpu { state, index })
    }

    /// The handle naming this GPU.
    pub(crate) fn handle(self) -> Device {
        self.index as Device + 1
    }

    /// Writes this GPU's handle to `out_handle`.
    pub(crate) fn write_handle(self, out_handle: *mut Device) -> Result<(), NvmlReturn> {
        out(out_handle, self.handle())
    }

    /// Capacity, use and each process's use of the GPU, as the machine counts them
    /// now (dead processes reclaimed first).
    pub(crate) fn usage(self) -> Result<GpuUsage, NvmlReturn> {
        self.state
            .machine
            .usage(self.index)
            .map_err(|_| NVML_ERROR_UNKNOWN)
    }

    pub(crate) fn count(state: &State) -> c_uint {
        state.machine.gpu_count()
    }
}
