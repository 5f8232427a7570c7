//! `NvmlSource` called directly on the GPU simulator's `libnvidia-ml.so.1`: every
//! field discovery fills (so struct layouts and string handling match the C API),
//! XID events (critical and application), and probes of a lost GPU.
//!
//! One test in its own binary: it points the simulator at a private machine through
//! the process environment, which is only safe with no other test threads around.

use std::time::Duration;

use kiwi_nvml::{GpuDiscovery, NvmlSource, Probe};
use kiwi_sim_core::harness::{in_ci, SimMachine};
use kiwi_sim_core::ident::gpu_uuid_string;
use kiwi_sim_core::Machine;

#[test]
fn nvml_source_on_the_simulator() {
    let m = match SimMachine::new("dp-inproc", 3, 2 << 30) {
        Ok(m) => m,
        Err(e) if !in_ci() => {
            eprintln!("SKIPPED: GPU simulator not available ({e}); CI=true would fail this test");
            return;
        }
        Err(e) => panic!("GPU simulator not available: {e}"),
    };
    for (k, v) in m.env() {
        if k.starts_with("KIWI_SIM_") {
            std::env::set_var(k, v);
        }
    }
    let lib = m.sim_dir.join("libnvidia-ml.so.1");
    let mut src = NvmlSource::load(lib.to_str().unwrap()).expect("simulator NVML loads");
    assert!(
        src.describe().starts_with("NVML, driver "),
        "{}",
        src.describe()
    );
    assert!(!src.describe().ends_with("unknown"), "{}", src.describe());

    let gpus = src.discover().unwrap();
    assert_eq!(gpus.len(), 3);
    for (i, g) in gpus.iter().enumerate() {
        assert_eq!(g.index, i as u32);
        assert_eq!(g.uuid, gpu_uuid_string(&m.name, i as u32));
        assert_eq!(g.name.as_deref(), Some("Kiwi Simulated GPU"));
        assert_eq!(g.memory_bytes, Some(2 << 30));
        assert_eq!(g.pci_bus_id, Some(format!("0000:{:02x}:00.0", 0x10 + i)));
        // No such PCI device in this machine's sysfs: no NUMA node.
        assert_eq!(g.numa_node, None);
        assert_eq!(src.probe(g), Probe::Ok);
    }

    let sim = Machine::open_existing(&m.name)
        .unwrap()
        .expect("machine exists");
    assert!(src.wait_faults(Duration::from_millis(50)).is_empty());
    // Application XIDs are not faults.
    sim.set_fault(2, 43, false).unwrap();
    assert!(src.wait_faults(Duration::from_millis(200)).is_empty());
    // A critical XID names its GPU.
    sim.set_fault(2, 79, false).unwrap();
    let faults = src.wait_faults(Duration::from_secs(5));
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert_eq!(faults[0].uuid.as_deref(), Some(gpus[2].uuid.as_str()));
    assert!(faults[0].reason.contains("79"), "{faults:?}");
    sim.set_fault(2, 0, false).unwrap();

    // Lost: probes fail with GPU_IS_LOST for that GPU only; clearing brings it back.
    sim.set_fault(1, 0, true).unwrap();
    match src.probe(&gpus[1]) {
        Probe::Failed(why) => assert!(why.contains("lost"), "{why}"),
        Probe::Ok => panic!("a lost GPU probed fine"),
    }
    assert_eq!(src.probe(&gpus[0]), Probe::Ok);
    sim.set_fault(1, 0, false).unwrap();
    assert_eq!(src.probe(&gpus[1]), Probe::Ok);
}
