//! The NVML stand-in, loaded in this process as the device plugin loads NVML:
//! same GPUs and UUIDs as the CUDA stand-in, memory info (each process's too) from
//! the shared machine,
//! Xid events and lost GPUs raised with `kiwi-sim fault`. (One test in this file:
//! the library reads its knobs from this process's environment.)

use std::ffi::{c_char, c_uint, c_void, CStr, CString};
use std::process::Command;

use kiwi_sim_core::harness::SimMachine;
use kiwi_sim_core::ident;

#[repr(C)]
#[derive(Default)]
struct Memory {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
struct PciInfo {
    bus_id_legacy: [c_char; 16],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pci_device_id: c_uint,
    pci_sub_system_id: c_uint,
    bus_id: [c_char; 32],
}

#[repr(C)]
#[derive(Default)]
struct EventData {
    device: usize,
    event_type: u64,
    event_data: u64,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

struct Lib(*mut c_void);

impl Lib {
    fn sym<T: Copy>(&self, name: &str) -> T {
        let c = CString::new(name).unwrap();
        // SAFETY: looking up a symbol in a library we opened.
        let p = unsafe { libc::dlsym(self.0, c.as_ptr()) };
        assert!(!p.is_null(), "libnvidia-ml.so.1 lacks {name}");
        assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
        // SAFETY: T is the function pointer type of that NVML symbol.
        unsafe { std::mem::transmute_copy(&p) }
    }
}

type Init = unsafe extern "C" fn() -> u32;
type Count = unsafe extern "C" fn(*mut c_uint) -> u32;
type ByIndex = unsafe extern "C" fn(c_uint, *mut usize) -> u32;
type ByUuid = unsafe extern "C" fn(*const c_char, *mut usize) -> u32;
type Str = unsafe extern "C" fn(usize, *mut c_char, c_uint) -> u32;
type Uint = unsafe extern "C" fn(usize, *mut c_uint) -> u32;
type Mem = unsafe extern "C" fn(usize, *mut Memory) -> u32;
type Procs = unsafe extern "C" fn(usize, *mut c_uint, *mut ProcessInfo) -> u32;

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct ProcessInfo {
    pid: c_uint,
    used_gpu_memory: u64,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}
type Pci = unsafe extern "C" fn(usize, *mut PciInfo) -> u32;
type SetCreate = unsafe extern "C" fn(*mut usize) -> u32;
type Register = unsafe extern "C" fn(usize, u64, usize) -> u32;
type Wait = unsafe extern "C" fn(usize, *mut EventData, c_uint) -> u32;
type SetFree = unsafe extern "C" fn(usize) -> u32;
type ErrStr = unsafe extern "C" fn(u32) -> *const c_char;

const TIMEOUT: u32 = 10;
const GPU_IS_LOST: u32 = 15;

fn kiwi_sim(args: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_kiwi-sim"))
        .args(args)
        .output()
        .unwrap();
    let t = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "kiwi-sim {args:?}: {t}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    t
}

fn string(buf: &[c_char]) -> String {
    // SAFETY: NVML wrote a NUL-terminated string into buf.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn nvml_reports_the_simulated_gpus_faults_and_events() {
    let m = SimMachine::new("nvml", 2, 512 << 20).unwrap_or_else(|e| panic!("{e}"));
    for (k, v) in m.env() {
        std::env::set_var(k, v);
    }
    let path = CString::new(m.sim_dir.join("libnvidia-ml.so.1").to_str().unwrap()).unwrap();
    // SAFETY: loading the simulator's NVML library by path.
    let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW) };
    assert!(!h.is_null(), "dlopen libnvidia-ml.so.1");
    let lib = Lib(h);
    // SAFETY: NVML entry points called with valid out-pointers and buffers.
    unsafe {
        let count: Count = lib.sym("nvmlDeviceGetCount_v2");
        let mut n = 0;
        assert_eq!(count(&mut n), 1, "calls before nvmlInit are UNINITIALIZED");
        assert_eq!(lib.sym::<Init>("nvmlInit_v2")(), 0);
        assert_eq!(count(&mut n), 0);
        assert_eq!(n, 2);
        let by_index: ByIndex = lib.sym("nvmlDeviceGetHandleByIndex_v2");
        let mut handles = [0usize; 2];
        for (i, hd) in handles.iter_mut().enumerate() {
            assert_eq!(by_index(i as c_uint, hd), 0);
            let mut buf = [0 as c_char; 96];
            assert_eq!(
                lib.sym::<Str>("nvmlDeviceGetUUID")(*hd, buf.as_mut_ptr(), 96),
                0
            );
            let uuid = string(&buf);
            assert_eq!(uuid, ident::gpu_uuid_string(&m.name, i as u32));
            let mut again = 0;
            let c = CString::new(uuid).unwrap();
            assert_eq!(
                lib.sym::<ByUuid>("nvmlDeviceGetHandleByUUID")(c.as_ptr(), &mut again),
                0
            );
            assert_eq!(again, *hd);
            let mut minor = 99;
            assert_eq!(
                lib.sym::<Uint>("nvmlDeviceGetMinorNumber")(*hd, &mut minor),
                0
            );
            assert_eq!(minor, i as c_uint);
            let mut mem = Memory::default();
            assert_eq!(lib.sym::<Mem>("nvmlDeviceGetMemoryInfo")(*hd, &mut mem), 0);
            assert_eq!((mem.total, mem.used, mem.free), (512 << 20, 0, 512 << 20));
            let mut pci: PciInfo = std::mem::zeroed();
            assert_eq!(lib.sym::<Pci>("nvmlDeviceGetPciInfo_v3")(*hd, &mut pci), 0);
            assert_eq!(string(&pci.bus_id), ident::pci_bus_id(i as u32));
            assert_eq!(pci.bus, ident::pci_bus(i as u32));
        }
        // Each process's memory: this one charges 96 MiB to GPU 1.
        let procs: Procs = lib.sym("nvmlDeviceGetComputeRunningProcesses_v3");
        let mut infos = [ProcessInfo::default(); 4];
        let mut n: c_uint = 4;
        assert_eq!(procs(handles[1], &mut n, infos.as_mut_ptr()), 0);
        assert_eq!(n, 0, "nobody has memory on it yet");
        let machine = kiwi_sim_core::Machine::open_existing(&m.name)
            .unwrap()
            .expect("the machine");
        machine.reserve(1, 96 << 20).unwrap();
        let mut none: c_uint = 0;
        assert_eq!(
            procs(handles[1], &mut none, std::ptr::null_mut()),
            7,
            "no room for the one process: INSUFFICIENT_SIZE"
        );
        assert_eq!(none, 1, "the count it needs");
        n = 4;
        assert_eq!(procs(handles[1], &mut n, infos.as_mut_ptr()), 0);
        assert_eq!(n, 1);
        assert_eq!(
            (infos[0].pid, infos[0].used_gpu_memory),
            (std::process::id(), 96 << 20)
        );
        machine.release(1, 96 << 20);
        n = 4;
        assert_eq!(procs(handles[0], &mut n, infos.as_mut_ptr()), 0);
        assert_eq!(n, 0, "GPU 0 has none of it");

        let mut small = [0 as c_char; 8];
        assert_eq!(
            lib.sym::<Str>("nvmlDeviceGetName")(handles[0], small.as_mut_ptr(), 8),
            7,
            "a short buffer is INSUFFICIENT_SIZE"
        );
        let mut bad = 0;
        assert_eq!(
            by_index(2, &mut bad),
            2,
            "index out of range is INVALID_ARGUMENT"
        );

        // Xid events.
        let mut set = 0usize;
        assert_eq!(lib.sym::<SetCreate>("nvmlEventSetCreate")(&mut set), 0);
        assert_eq!(
            lib.sym::<Register>("nvmlDeviceRegisterEvents")(handles[1], 0x8, set),
            0
        );
        let wait: Wait = lib.sym("nvmlEventSetWait_v2");
        let mut ev = EventData::default();
        assert_eq!(wait(set, &mut ev, 50), TIMEOUT);
        kiwi_sim(&["fault", "--gpu", "1", "--xid", "79", "--name", &m.name]);
        assert_eq!(wait(set, &mut ev, 5000), 0);
        assert_eq!(
            (ev.device, ev.event_type, ev.event_data),
            (handles[1], 0x8, 79)
        );
        assert_eq!(
            wait(set, &mut ev, 50),
            TIMEOUT,
            "each fault is reported once"
        );
        assert_eq!(lib.sym::<SetFree>("nvmlEventSetFree")(set), 0);

        // A lost GPU: handles are refused.
        kiwi_sim(&["fault", "--gpu", "0", "--lost", "--name", &m.name]);
        let mut hd = 0;
        assert_eq!(by_index(0, &mut hd), GPU_IS_LOST);
        let status = kiwi_sim(&["status", "--json", "--name", &m.name]);
        assert!(status.contains("\"lost\":true"), "{status}");
        kiwi_sim(&["fault", "--gpu", "0", "--clear", "--name", &m.name]);
        assert_eq!(by_index(0, &mut hd), 0);
        let msg = CStr::from_ptr(lib.sym::<ErrStr>("nvmlErrorString")(GPU_IS_LOST));
        assert!(!msg.to_bytes().is_empty());
    }
}
