//! Whole-process eviction through the driver's checkpoint API (issue #25): what no
//! swap frees (a client's contexts, modules, the memory its shim cannot move) leaves
//! the GPU when the driver checkpoints the process, and comes back at the same
//! addresses when it restores it. `docs/checkpoint.md` has the API's facts and
//! sources.
//!
//! This module owns the driver side: [`Checkpointer`], the small trait the daemon
//! drives (blocking calls, made off the daemon's thread), with [`DriverCheckpointer`]
//! over `libcuda.so.1` loaded with `dlopen` at run time (as NVML is: the arbiter
//! builds and runs without the driver) and a fake for tests. Which processes are
//! evicted and when is the scheduler's (`sched.rs`).

use std::ffi::{c_int, c_uint, c_void};
use std::time::Duration;

/// Why a process could not be checkpointed or restored: the driver's result and the
/// step that returned it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{step}: {}", result_name(*.code))]
pub struct CheckpointError {
    pub step: &'static str,
    pub code: i32,
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

const CUDA_SUCCESS: i32 = 0;
const CUDA_ERROR_INVALID_VALUE: i32 = 1;
const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;
const CUDA_ERROR_NOT_INITIALIZED: i32 = 3;
const CUDA_ERROR_ILLEGAL_STATE: i32 = 401;
const CUDA_ERROR_NOT_READY: i32 = 600;
const CUDA_ERROR_NOT_PERMITTED: i32 = 800;
const CUDA_ERROR_NOT_SUPPORTED: i32 = 801;

const STATE_RUNNING: c_uint = 0;
const STATE_LOCKED: c_uint = 1;
const STATE_CHECKPOINTED: c_uint = 2;

/// The driver's name for a result (the ones this API documents), else its number.
pub fn result_name(code: i32) -> String {
    match code {
        CUDA_SUCCESS => "CUDA_SUCCESS".into(),
        CUDA_ERROR_INVALID_VALUE => "CUDA_ERROR_INVALID_VALUE (no CUDA state there)".into(),
        CUDA_ERROR_OUT_OF_MEMORY => "CUDA_ERROR_OUT_OF_MEMORY".into(),
        CUDA_ERROR_NOT_INITIALIZED => "CUDA_ERROR_NOT_INITIALIZED".into(),
        CUDA_ERROR_ILLEGAL_STATE => "CUDA_ERROR_ILLEGAL_STATE".into(),
        CUDA_ERROR_NOT_READY => "CUDA_ERROR_NOT_READY (the lock timed out)".into(),
        CUDA_ERROR_NOT_PERMITTED => "CUDA_ERROR_NOT_PERMITTED".into(),
        CUDA_ERROR_NOT_SUPPORTED => {
            "CUDA_ERROR_NOT_SUPPORTED (managed or IPC memory, or no driver support)".into()
        }
        c => format!("CUresult {c}"),
    }
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
}

type GetState = unsafe extern "C" fn(c_int, *mut c_uint) -> c_int;
type Step = unsafe extern "C" fn(c_int, *mut c_void) -> c_int;

/// `CUcheckpointLockArgs` (cuda.h 12.8+): the other argument structs are 8 reserved
/// words, all zero.
#[repr(C)]
struct LockArgs {
    timeout_ms: c_uint,
    reserved0: c_uint,
    reserved1: [u64; 7],
}

/// The checkpoint API of the node's driver, `libcuda.so.1`.
#[derive(Debug)]
pub struct DriverCheckpointer {
    _lib: libloading::Library,
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
        // SAFETY: loading the CUDA driver runs its initializers, which have no
        // preconditions on the loading process.
        let lib = unsafe { libloading::Library::new("libcuda.so.1") }
            .map_err(|e| format!("no CUDA driver ({e})"))?;
        /// Looks up `name`, whose C signature is `T`.
        fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T, String> {
            // SAFETY: `T` is the signature `cuda.h` declares for `name`.
            unsafe { lib.get::<T>(name.as_bytes()) }
                .map(|s| *s)
                .map_err(|_| format!("the driver has no {name} (driver 570 or later has it)"))
        }
        let init: unsafe extern "C" fn(c_uint) -> c_int = sym(&lib, "cuInit")?;
        let get_state: GetState = sym(&lib, "cuCheckpointProcessGetState")?;
        let lock: Step = sym(&lib, "cuCheckpointProcessLock")?;
        let checkpoint: Step = sym(&lib, "cuCheckpointProcessCheckpoint")?;
        let restore: Step = sym(&lib, "cuCheckpointProcessRestore")?;
        let unlock: Step = sym(&lib, "cuCheckpointProcessUnlock")?;
        // SAFETY: cuInit(0) takes no pointers.
        let rc = unsafe { init(0) };
        if rc != CUDA_SUCCESS {
            return Err(format!("cuInit: {}", result_name(rc)));
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

fn ok(step: &'static str, rc: c_int) -> Result<(), CheckpointError> {
    if rc == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CheckpointError { step, code: rc })
    }
}

impl Checkpointer for DriverCheckpointer {
    fn checkpoint(&self, pid: u32, lock_timeout: Duration) -> Result<(), CheckpointError> {
        if self.state(pid)? != STATE_RUNNING {
            return Err(CheckpointError {
                step: "lock",
                code: CUDA_ERROR_ILLEGAL_STATE,
            });
        }
        let mut args = LockArgs {
            timeout_ms: lock_timeout.as_millis().clamp(1, u32::MAX.into()) as c_uint,
            reserved0: 0,
            reserved1: [0; 7],
        };
        // SAFETY: a pid and a whole, zeroed-but-the-timeout CUcheckpointLockArgs.
        let rc = unsafe { (self.lock)(pid as c_int, (&mut args as *mut LockArgs).cast()) };
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
        if st == STATE_CHECKPOINTED {
            self.step(self.restore, "restore", pid)?;
        } else if st != STATE_LOCKED {
            return Ok(());
        }
        self.step(self.unlock, "unlock", pid)
    }
}

/// A [`Checkpointer`] for tests: records the calls, refuses the pids it is told to.
#[derive(Debug, Default)]
pub struct FakeCheckpointer {
    pub calls: std::sync::Mutex<Vec<(&'static str, u32)>>,
    pub refuse: std::sync::Mutex<Vec<u32>>,
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
        Ok(())
    }

    fn restore(&self, pid: u32) -> Result<(), CheckpointError> {
        self.calls.lock().expect("lock").push(("restore", pid));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
