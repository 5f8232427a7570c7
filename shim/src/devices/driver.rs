//! [`RealDriver`]: the allocator's [`Driver`] over the real driver's originals, for one
//! device (VMM calls, copies, page-locked host buffers), and the stream a
//! stream-ordered free waits for.

use super::*;

/// The real driver, for one device, through the originals.
#[derive(Clone, Copy)]
pub struct RealDriver {
    pub(super) device: CUdevice,
}

impl Driver for RealDriver {
    fn granularity(&self) -> Result<u64, CUresult> {
        let prop = CUmemAllocationProp::device(self.device);
        let mut g: usize = 0;
        call!(cuMemGetAllocationGranularity: fn(*mut usize, *const CUmemAllocationProp, c_int)
            (&mut g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM))?;
        Ok(g as u64)
    }
    fn reserve(&self, size: u64, align: u64) -> Result<u64, CUresult> {
        let mut va: CUdeviceptr = 0;
        call!(cuMemAddressReserve: fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64)
            (&mut va, size as usize, align as usize, 0, 0))?;
        Ok(va)
    }
    fn free_va(&self, va: u64, size: u64) -> Result<(), CUresult> {
        call!(cuMemAddressFree: fn(CUdeviceptr, usize)(va, size as usize))
    }
    fn create(&self, size: u64) -> Result<u64, CUresult> {
        // Exportable (POSIX fd), for CUDA IPC ([`crate::ipc`]), unless the driver refuses.
        let mut prop = alloc_prop(self.device);
        let mut h: CUmemGenericAllocationHandle = 0;
        let mut create = |prop: &CUmemAllocationProp| {
            call!(cuMemCreate: fn(*mut CUmemGenericAllocationHandle, usize, *const CUmemAllocationProp, u64)
            (&mut h, size as usize, prop, 0))
        };
        match create(&prop) {
            Err(e) if create_refused(&prop, e) => {
                prop.requested_handle_types = 0;
                create(&prop)?;
            }
            r => {
                r?;
                if prop.requested_handle_types != 0 {
                    created_exportable();
                }
            }
        }
        Ok(h)
    }
    fn create_like(&self, size: u64, prop: &crate::mem::AppProp) -> Result<u64, CUresult> {
        let mut h: CUmemGenericAllocationHandle = 0;
        call!(cuMemCreate: fn(*mut CUmemGenericAllocationHandle, usize, *const CUmemAllocationProp, u64)
            (&mut h, size as usize, &prop.0, 0))?;
        Ok(h)
    }
    fn release(&self, handle: u64) -> Result<(), CUresult> {
        call!(cuMemRelease: fn(CUmemGenericAllocationHandle)(handle))
    }
    fn map(&self, va: u64, size: u64, handle: u64) -> Result<(), CUresult> {
        call!(cuMemMap: fn(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, u64)
            (va, size as usize, 0, handle, 0))?;
        let desc = CUmemAccessDesc {
            location: CUmemLocation {
                type_: CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.device,
            },
            flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let r = call!(cuMemSetAccess: fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize)
            (va, size as usize, &desc, 1));
        if r.is_err() {
            let _ = self.unmap(va, size);
        }
        r
    }
    fn unmap(&self, va: u64, size: u64) -> Result<(), CUresult> {
        call!(cuMemUnmap: fn(CUdeviceptr, usize)(va, size as usize))
    }
    fn set_access(&self, va: u64, size: u64, grants: &[crate::mem::Grant]) -> Result<(), CUresult> {
        let descs: Vec<CUmemAccessDesc> = grants
            .iter()
            .map(|&(id, flags)| CUmemAccessDesc {
                location: CUmemLocation {
                    type_: CU_MEM_LOCATION_TYPE_DEVICE,
                    id,
                },
                flags,
            })
            .collect();
        call!(cuMemSetAccess: fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize)
            (va, size as usize, descs.as_ptr(), descs.len()))
    }
    fn host_alloc(&self, size: u64) -> Result<*mut u8, CUresult> {
        pinned::alloc(size)
    }
    fn host_free(&self, p: *mut u8, size: u64) {
        pinned::free(p, size)
    }
    fn pageable_alloc(&self, size: u64) -> Option<*mut u8> {
        pinned::alloc_pageable(size)
    }
    fn pageable_free(&self, p: *mut u8, size: u64) {
        pinned::free_pageable(p, size)
    }
    fn host_register(&self, p: *mut u8, size: u64) -> Result<(), CUresult> {
        pinned::register(p, size)
    }
    fn host_spill(&self, p: *mut u8, size: u64) -> Option<u64> {
        pinned::spill(p, size)
    }
    fn host_spillable(&self, p: *mut u8) -> bool {
        crate::pool::owns(p)
    }
    fn spilled_to_device(&self, h: u64, va: u64, pieces: &[(u64, u64)]) -> Result<(), CUresult> {
        crate::pool::read_back(h, |base, len| {
            for &(off, n) in pieces {
                if off.checked_add(n).is_none_or(|end| end > len as u64) {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
                // SAFETY: `[base + off, base + off + n)` lies in the read-only mapping
                // of the spill files, valid for the whole closure.
                unsafe { self.to_device(va + off, base.add(off as usize), n) }?;
            }
            Ok(())
        })
        .unwrap_or_else(|| {
            crate::kerror!(
                "cannot map this process's swapped-out memory back from the swap pool's disk tier"
            );
            Err(CUDA_ERROR_UNKNOWN)
        })
    }
    fn spill_free(&self, h: u64) {
        crate::pool::forget(h)
    }
    unsafe fn to_host(&self, dst: *mut u8, src: u64, n: u64) -> Result<(), CUresult> {
        call!(cuMemcpyDtoH_v2: fn(*mut c_void, CUdeviceptr, usize)(dst as *mut c_void, src, n as usize))
    }
    unsafe fn to_device(&self, dst: u64, src: *const u8, n: u64) -> Result<(), CUresult> {
        call!(cuMemcpyHtoD_v2: fn(CUdeviceptr, *const c_void, usize)(dst, src as *const c_void, n as usize))
    }
    // Swap copies run on the context's legacy default stream: the application's work is
    // drained and the gate closed while the shim swaps, so nothing else is queued there,
    // and the copy engine moves one segment while the shim maps or pins the next.
    unsafe fn to_host_async(&self, dst: *mut u8, src: u64, n: u64) -> Result<(), CUresult> {
        call!(cuMemcpyDtoHAsync_v2: fn(*mut c_void, CUdeviceptr, usize, CUstream)
            (dst as *mut c_void, src, n as usize, null_mut()))
    }
    unsafe fn to_device_async(&self, dst: u64, src: *const u8, n: u64) -> Result<(), CUresult> {
        call!(cuMemcpyHtoDAsync_v2: fn(CUdeviceptr, *const c_void, usize, CUstream)
            (dst, src as *const c_void, n as usize, null_mut()))
    }
    fn wait_copies(&self) -> Result<(), CUresult> {
        call!(cuStreamSynchronize: fn(CUstream)(null_mut()))
    }
    fn copies_done(&self) -> Option<bool> {
        match call!(cuStreamQuery: fn(CUstream)(null_mut())) {
            Ok(()) => Some(true),
            // Still copying.
            Err(CUDA_ERROR_NOT_READY) => Some(false),
            Err(_) => None,
        }
    }
    // A free waits for the work that may still use the memory: a stream-ordered free
    // for its own stream only ([`FREE_STREAM`]), any other free for the context, never
    // while a stream captures (the driver would refuse and invalidate the capture;
    // frees during a capture are deferred before they get here, see `hooks::mem_free`).
    fn sync(&self) -> Result<(), CUresult> {
        if let Some(s) = FREE_STREAM.get() {
            return call!(cuStreamSynchronize: fn(CUstream)(s.handle_for_legacy_entry()));
        }
        crate::capture::sync_unless_capturing(|| call!(cuCtxSynchronize: fn()()))
            .unwrap_or(Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED))
    }
}

thread_local! {
    /// The stream a stream-ordered free on this thread waits for ([`crate::hooks::mem_free_async`]).
    pub(crate) static FREE_STREAM: std::cell::Cell<Option<crate::capture::StreamArg>> =
        const { std::cell::Cell::new(None) };
}
