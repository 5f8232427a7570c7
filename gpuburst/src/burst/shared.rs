//! The memory of a CUDA IPC pair (`--ipc`): the exporter's one more allocation,
//! published, and the importer's view of it; at the end, the importer's close and
//! the exporter's wait for it.

use std::time::Duration;

use crate::cu;
use crate::driver::{Cuda, IpcMemHandle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS};
use crate::ipc::{self, IpcSpec, Role};
use crate::memory::Source;

use super::device::{mem_kernel, mix, resize_sums, Allocation, Device};
use super::verify::{verify, verify_all};
use super::{Failure, Options};

/// The value index of an exporter's shared allocation: past any of its own.
const SHARED_INDEX: u64 = 1 << 32;

/// `--ipc export:`: one more `cuMemAlloc` of `--ipc-mem` on `d` (its context
/// current), filled with its value and synchronized, its handle published in FILE.
fn export_shared(
    cuda: &Cuda,
    o: &Options,
    d: &mut Device,
    spec: &IpcSpec,
) -> Result<ipc::Published, Failure> {
    let mut ptr = 0;
    cu!(
        cuda,
        mem_alloc,
        "cuMemAlloc_v2",
        &mut ptr,
        o.ipc_mem as usize
    )?;
    let a = Allocation {
        ptr,
        words: o.ipc_mem / 4,
        value: mix(o.seed, 0, SHARED_INDEX),
        source: Source::Exported,
    };
    mem_kernel(cuda, d.k.fill, &a, a.value)?;
    cu!(cuda, ctx_synchronize, "cuCtxSynchronize")?;
    let mut handle = IpcMemHandle { reserved: [0; 64] };
    cu!(
        cuda,
        ipc_get_mem_handle,
        "cuIpcGetMemHandle",
        &mut handle,
        ptr
    )?;
    let p = ipc::Published {
        pid: std::process::id(),
        bytes: a.words * 4,
        value: a.value,
        handle,
    };
    d.allocs.push(a);
    resize_sums(cuda, d)?;
    ipc::publish(&spec.path, &p).map_err(Failure::Input)?;
    Ok(p)
}

/// `--ipc import:`: waits for the exporter's FILE, opens its memory on `d` (its
/// context current) as an allocation of `d` that keeps the exporter's value, and
/// verifies `d` at once.
fn import_shared(
    cuda: &Cuda,
    o: &Options,
    d: &mut Device,
    spec: &IpcSpec,
) -> Result<ipc::Published, Failure> {
    let timeout = Duration::from_millis(o.ipc_timeout_ms);
    let p = ipc::wait_published(&spec.path, timeout).map_err(|e| match e {
        ipc::WaitError::Timeout(m) => Failure::Timeout(m),
        ipc::WaitError::Bad(m) => Failure::Input(m),
    })?;
    let mut ptr = 0;
    cu!(
        cuda,
        ipc_open_mem_handle,
        "cuIpcOpenMemHandle",
        &mut ptr,
        p.handle,
        CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    )?;
    d.allocs.push(Allocation {
        ptr,
        words: p.bytes / 4,
        value: p.value,
        source: Source::Imported,
    });
    resize_sums(cuda, d)?;
    verify(cuda, d)?;
    Ok(p)
}

/// `--ipc`: the exporter's shared allocation made and published, or the exporter's
/// opened and verified by the importer, on the one device (checked by the options).
pub(super) fn open(
    cuda: &Cuda,
    o: &Options,
    devs: &mut [Device],
) -> Result<Option<ipc::Published>, Failure> {
    Ok(match &o.ipc {
        Some(spec) if spec.role == Role::Export => {
            Some(export_shared(cuda, o, &mut devs[0], spec)?)
        }
        Some(spec) => Some(import_shared(cuda, o, &mut devs[0], spec)?),
        None => None,
    })
}

/// `--ipc`, once the run is verified: the importer closes the shared memory and says
/// so; the exporter waits for that (at most `--ipc-timeout-ms`) and verifies again.
pub(super) fn finish(cuda: &Cuda, o: &Options, devs: &[Device]) -> Result<(), Failure> {
    match &o.ipc {
        Some(spec) if spec.role == Role::Import => {
            for a in devs[0]
                .allocs
                .iter()
                .filter(|a| a.source == Source::Imported)
            {
                cu!(cuda, ipc_close_mem_handle, "cuIpcCloseMemHandle", a.ptr)?;
            }
            ipc::mark_closed(&spec.path).map_err(Failure::Input)?;
        }
        Some(spec) => {
            // The exporter stays, its memory shared, until the importer closed it.
            if !ipc::wait_closed(&spec.path, Duration::from_millis(o.ipc_timeout_ms)) {
                return Err(Failure::Timeout(format!(
                    "--ipc export: the importer did not close {} within {} ms",
                    spec.path.display(),
                    o.ipc_timeout_ms
                )));
            }
            // Closed, the shared memory may have been swapped meanwhile: once more.
            verify_all(cuda, devs)?;
        }
        None => {}
    }
    Ok(())
}
