//! Whole-process eviction through the driver's checkpoint API (issue #25): what no
//! swap frees (a client's contexts, modules, the memory its shim cannot move) leaves
//! the GPU when the driver checkpoints the process, and comes back at the same
//! addresses when it restores it. `docs/checkpoint.md` has the API's facts and
//! sources.
//!
//! This module owns the driver side: [`Checkpointer`], the small trait the daemon
//! drives (blocking calls, made off the daemon's thread), with [`DriverCheckpointer`]
//! over `libcuda.so.1` loaded at run time by `kiwi_cuda`'s loader (as NVML is: the
//! arbiter builds and runs without the driver) and a fake for tests. Which processes are
//! evicted and when is the scheduler's (`sched.rs`).

use std::ffi::{c_int, c_uint, c_void, CStr};
use std::time::Duration;

use kiwi_cuda::sys::{
    CUcheckpointLockArgs, CUresult, CUDA_ERROR_ILLEGAL_STATE, CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_PERMITTED, CUDA_ERROR_NOT_READY, CUDA_ERROR_NOT_SUPPORTED,
    CU_PROCESS_STATE_CHECKPOINTED, CU_PROCESS_STATE_LOCKED, CU_PROCESS_STATE_RUNNING,
};
use kiwi_cuda::{CudaError, Library, LoadError};

/// Why a process could not be checkpointed or restored: the driver's result and the
/// step that returned it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{step}: {}", result_name(*.code))]
pub struct CheckpointError {
    pub step: &'static str,
    pub code: CUresult,
}

impl CheckpointError {
    /// A refusal that says the process can never be checkpointed (managed or IPC
    /// memory, an unsupported driver), as opposed to one worth trying again later
    /// (a lock that timed out, no room to restore yet).
    pub fn permanent(&self) -> bool {
        matches!(
            self.code,
            CUDA_ERROR_NOT_SUPPORTED | CUDA_ERROR_INVALID_VALUE | CUDA_ERROR_NOT_PERMITTED
        )
    }
}

/// The driver's name for a result (`kiwi_cuda`'s table), with what it means for this
/// API where the API documents it, else its number.
pub fn result_name(code: CUresult) -> String {
    let meaning = match code {
        CUDA_ERROR_INVALID_VALUE => " (no CUDA state there)",
        CUDA_ERROR_NOT_READY => " (the lock timed out)",
        CUDA_ERROR_NOT_SUPPORTED => " (managed or IPC memory, or no driver support)",
        _ => "",
    };
    format!("{}{meaning}", CudaError(code))
}

/// Checkpoints and restores whole processes by host pid. Calls block (a checkpoint
/// copies the process's device memory out), so the daemon makes them off its thread.
pub trait Checkpointer: Send + Sync + std::fmt::Debug {
    /// Locks `pid` (waiting at most `lock_timeout` for its submitted work) and
    /// checkpoints it; on a refusal the process is left running as it was.
    fn checkpoint(&self, pid: u32, lock_timeout: Duration) -> Result<(), CheckpointError>;
    /// Restores and unlocks `pid` (whatever step it was left at); out of memory while
    /// its memory does not fit yet.
    fn restore(&self, pid: u32) -> Result<(), CheckpointError>;
    /// Where the driver holds `pid` now.
    fn held(&self, pid: u32) -> Result<Held, CheckpointError>;
}

/// Where the driver holds a process (`CUprocessState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// Running: its calls go on.
    Running,
    /// Locked: its calls wait, its memory still on the GPU.
    Locked,
    /// Checkpointed: its calls wait, its GPU state in its host memory.
    Checkpointed,
}

type GetState = unsafe extern "C" fn(c_int, *mut c_uint) -> CUresult;
type Step = unsafe extern "C" fn(c_int, *mut c_void) -> CUresult;

/// The checkpoint API of the node's driver, `libcuda.so.1`.
#[derive(Debug)]
pub struct DriverCheckpointer {
    _lib: Library,
    get_state: GetState,
    lock: Step,
    checkpoint: Step,
    restore: Step,
    unlock: Step,
}

impl DriverCheckpointer {
    /// Loads the driver and initializes it (a restore needs `cuInit` in the caller);
    /// `Err` says why the API cannot be used here, in one line.
    pub fn load() -> Result<DriverCheckpointer, String> {
        let lib = Library::libcuda().map_err(|e| match e {
            LoadError::Open { reason, .. } => format!("no CUDA driver ({reason})"),
            e => format!("no CUDA driver ({e})"),
        })?;
        /// Looks up `name`, whose C signature is `T`.
        fn sym<T: Copy>(lib: &Library, name: &CStr) -> Result<T, String> {
            // SAFETY: `T` is the signature `cuda.h` declares for `name`.
            unsafe { lib.get::<T>(name) }.map_err(|_| {
                format!(
                    "the driver has no {} (driver 570 or later has it)",
                    name.to_string_lossy()
                )
            })
        }
        let init: unsafe extern "C" fn(c_uint) -> CUresult = sym(&lib, c"cuInit")?;
        let get_state: GetState = sym(&lib, c"cuCheckpointProcessGetState")?;
        let lock: Step = sym(&lib, c"cuCheckpointProcessLock")?;
        let checkpoint: Step = sym(&lib, c"cuCheckpointProcessCheckpoint")?;
        let restore: Step = sym(&lib, c"cuCheckpointProcessRestore")?;
        let unlock: Step = sym(&lib, c"cuCheckpointProcessUnlock")?;
        // SAFETY: cuInit(0) takes no pointers.
        let rc = unsafe { init(0) };
        if let Err(e) = kiwi_cuda::check(rc) {
            return Err(format!("cuInit: {}", result_name(e.code())));
        }
        let d = DriverCheckpointer {
            _lib: lib,
            get_state,
            lock,
            checkpoint,
            restore,
            unlock,
        };
        // A driver that has the symbols but not the feature says so for any pid (the
        // arbiter's own, which has CUDA state now); other answers are per process.
        match d.state(std::process::id()) {
            Err(e) if e.code == CUDA_ERROR_NOT_SUPPORTED => {
                Err(format!("the driver does not support it ({e})"))
            }
            _ => Ok(d),
        }
    }

    fn state(&self, pid: u32) -> Result<c_uint, CheckpointError> {
        let mut st: c_uint = u32::MAX;
        // SAFETY: a pid and a valid out-pointer, as cuda.h declares.
        let rc = unsafe { (self.get_state)(pid as c_int, &mut st) };
        ok("get state", rc).map(|()| st)
    }

    fn step(&self, f: Step, step: &'static str, pid: u32) -> Result<(), CheckpointError> {
        // SAFETY: NULL args are allowed ("optional") for every step.
        let rc = unsafe { f(pid as c_int, std::ptr::null_mut()) };
        ok(step, rc)
    }
}

fn ok(step: &'static str, rc: CUresult) -> Result<(), CheckpointError> {
    kiwi_cuda::check(rc).map_err(|e| CheckpointError {
        step,
        code: e.code(),
    })
}

impl Checkpointer for DriverCheckpointer {
    fn checkpoint(&self, pid: u32, lock_timeout: Duration) -> Result<(), CheckpointError> {
        if self.state(pid)? != CU_PROCESS_STATE_RUNNING {
            return Err(CheckpointError {
                step: "lock",
                code: CUDA_ERROR_ILLEGAL_STATE,
            });
        }
        let mut args = CUcheckpointLockArgs {
            timeout_ms: lock_timeout.as_millis().clamp(1, u32::MAX.into()) as c_uint,
            ..CUcheckpointLockArgs::default()
        };
        // SAFETY: a pid and a whole, zeroed-but-the-timeout CUcheckpointLockArgs.
        let rc = unsafe {
            (self.lock)(
                pid as c_int,
                (&mut args as *mut CUcheckpointLockArgs).cast(),
            )
        };
        ok("lock", rc)?;
        if let Err(e) = self.step(self.checkpoint, "checkpoint", pid) {
            // Refused (managed or IPC memory): the process goes on as it was.
            let _ = self.step(self.unlock, "unlock", pid);
            return Err(e);
        }
        Ok(())
    }

    fn restore(&self, pid: u32) -> Result<(), CheckpointError> {
        let st = self.state(pid)?;
        if st == CU_PROCESS_STATE_CHECKPOINTED {
            self.step(self.restore, "restore", pid)?;
        } else if st != CU_PROCESS_STATE_LOCKED {
            return Ok(());
        }
        self.step(self.unlock, "unlock", pid)
    }

    fn held(&self, pid: u32) -> Result<Held, CheckpointError> {
        Ok(match self.state(pid)? {
            CU_PROCESS_STATE_CHECKPOINTED => Held::Checkpointed,
            CU_PROCESS_STATE_LOCKED => Held::Locked,
            _ => Held::Running,
        })
    }
}

/// A [`Checkpointer`] for tests: records the calls, refuses the pids it is told to.
#[derive(Debug, Default)]
pub struct FakeCheckpointer {
    pub calls: std::sync::Mutex<Vec<(&'static str, u32)>>,
    pub refuse: std::sync::Mutex<Vec<u32>>,
    /// Processes the driver holds checkpointed (the others run); a checkpoint adds
    /// its pid, a restore takes it away.
    pub checkpointed: std::sync::Mutex<Vec<u32>>,
}

impl Checkpointer for FakeCheckpointer {
    fn checkpoint(&self, pid: u32, _t: Duration) -> Result<(), CheckpointError> {
        self.calls.lock().expect("lock").push(("checkpoint", pid));
        if self.refuse.lock().expect("lock").contains(&pid) {
            return Err(CheckpointError {
                step: "checkpoint",
                code: CUDA_ERROR_NOT_SUPPORTED,
            });
        }
        self.checkpointed.lock().expect("lock").push(pid);
        Ok(())
    }

    fn restore(&self, pid: u32) -> Result<(), CheckpointError> {
        self.calls.lock().expect("lock").push(("restore", pid));
        self.checkpointed
            .lock()
            .expect("lock")
            .retain(|&p| p != pid);
        Ok(())
    }

    fn held(&self, pid: u32) -> Result<Held, CheckpointError> {
        self.calls.lock().expect("lock").push(("held", pid));
        Ok(if self.checkpointed.lock().expect("lock").contains(&pid) {
            Held::Checkpointed
        } else {
            Held::Running
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiwi_cuda::sys::CUDA_ERROR_OUT_OF_MEMORY;

    #[test]
    fn refusals_read_as_the_driver_names_them_and_say_whether_to_try_again() {
        let e = CheckpointError {
            step: "checkpoint",
            code: CUDA_ERROR_NOT_SUPPORTED,
        };
        assert!(e
            .to_string()
            .starts_with("checkpoint: CUDA_ERROR_NOT_SUPPORTED"));
        assert!(e.permanent());
        let timeout = CheckpointError {
            step: "lock",
            code: CUDA_ERROR_NOT_READY,
        };
        assert!(!timeout.permanent());
        assert!(!CheckpointError {
            step: "restore",
            code: CUDA_ERROR_OUT_OF_MEMORY
        }
        .permanent());
    }
}
