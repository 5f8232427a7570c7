//! `kiwi-sim`: operate the GPU simulator from a shell.
//!
//! ```text
//! kiwi-sim install-dir [--profile-dir DIR]   copy the cdylibs into DIR/sim/
//! kiwi-sim status [--name N] [--json]       capacity/use per GPU, processes, faults
//! kiwi-sim fault --gpu G (--xid X [--lost] | --lost | --clear) [--name N]
//! kiwi-sim reset [--name N]                 remove the machine's shared segment
//! kiwi-sim populate [--name N] [--gpu G]    fault in each GPU's memory file up to
//!                                           its capacity, from this process
//! ```
//! The machine is `--name`, else `KIWI_SIM_NAME`, else `default`.

use anyhow::{bail, Context, Result};
use kiwi_sim_core::machine::{reset, Machine};
use kiwi_sim_core::{ident, install_sim_dir, profile_dir_of_current_exe, SimConfig};
use std::path::PathBuf;

const USAGE: &str = "usage: kiwi-sim install-dir [--profile-dir DIR] | status [--name N] [--json] | fault --gpu G (--xid X [--lost] | --lost | --clear) [--name N] | reset [--name N] | populate [--name N] [--gpu G]";

struct Args {
    rest: Vec<String>,
}

impl Args {
    fn flag(&mut self, name: &str) -> bool {
        if let Some(i) = self.rest.iter().position(|a| a == name) {
            self.rest.remove(i);
            true
        } else {
            false
        }
    }

    fn value(&mut self, name: &str) -> Result<Option<String>> {
        let Some(i) = self.rest.iter().position(|a| a == name) else {
            return Ok(None);
        };
        if i + 1 >= self.rest.len() {
            bail!("{name} needs a value");
        }
        let v = self.rest.remove(i + 1);
        self.rest.remove(i);
        Ok(Some(v))
    }

    fn done(self) -> Result<()> {
        if let Some(a) = self.rest.first() {
            bail!("unexpected argument {a:?}; {USAGE}");
        }
        Ok(())
    }

    fn name(&mut self) -> Result<String> {
        match self.value("--name")? {
            Some(n) => Ok(n),
            None => Ok(SimConfig::from_env()
                .map(|c| c.name)
                .unwrap_or_else(|_| std::env::var("KIWI_SIM_NAME").unwrap_or("default".into()))),
        }
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("kiwi-sim: {}", kiwi_config::one_line(e.as_ref()));
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let mut argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.is_empty() || argv[0] == "-h" || argv[0] == "--help" {
        println!("{USAGE}");
        return Ok(());
    }
    let cmd = argv.remove(0);
    let mut a = Args { rest: argv };
    match cmd.as_str() {
        "install-dir" => {
            let profile = match a.value("--profile-dir")? {
                Some(d) => PathBuf::from(d),
                None => profile_dir_of_current_exe().context("locating the profile directory")?,
            };
            a.done()?;
            let dir = install_sim_dir(&profile)?;
            println!("{}", dir.display());
        }
        "status" => {
            let name = a.name()?;
            let json = a.flag("--json");
            a.done()?;
            status(&name, json)?;
        }
        "fault" => {
            let name = a.name()?;
            let gpu: u32 = a
                .value("--gpu")?
                .context("fault needs --gpu N")?
                .parse()
                .context("--gpu must be a GPU index")?;
            let clear = a.flag("--clear");
            let lost = a.flag("--lost");
            let xid: Option<u64> = a
                .value("--xid")?
                .map(|x| x.parse().context("--xid must be a number"))
                .transpose()?;
            a.done()?;
            let (xid, lost) = match (clear, xid, lost) {
                (true, None, false) => (0, false),
                (true, _, _) => bail!("--clear cannot be combined with --xid or --lost"),
                (false, Some(0), _) => bail!("--xid must be non-zero (use --clear)"),
                (false, Some(x), l) => (x, l),
                // A lost GPU reports Xid 79 ("fallen off the bus") unless told otherwise.
                (false, None, true) => (79, true),
                (false, None, false) => bail!("fault needs --xid X, --lost or --clear"),
            };
            let m = Machine::open_existing(&name)?
                .with_context(|| format!("no simulated machine named {name:?} is running"))?;
            m.set_fault(gpu, xid, lost)?;
            if xid == 0 {
                println!("cleared faults on simulated GPU {gpu} of {name}");
            } else {
                println!(
                    "simulated GPU {gpu} of {name}: Xid {xid}{}",
                    if lost { ", lost" } else { "" }
                );
            }
        }
        "reset" => {
            let name = a.name()?;
            a.done()?;
            if reset(&name)? {
                println!("removed simulated machine {name}");
            } else {
                println!("no simulated machine named {name}");
            }
        }
        "populate" => {
            let name = a.name()?;
            let gpu: Option<u32> = a
                .value("--gpu")?
                .map(|g| g.parse().context("--gpu must be a GPU index"))
                .transpose()?;
            a.done()?;
            populate(&name, gpu)?;
        }
        other => bail!("unknown command {other:?}; {USAGE}"),
    }
    Ok(())
}

/// Populates the memory files of machine `name` (created from the environment's
/// knobs, as the first CUDA program would, when nobody has yet).
fn populate(name: &str, gpu: Option<u32>) -> Result<()> {
    let m = match Machine::open_existing(name)? {
        Some(m) => m,
        None => {
            let mut cfg = SimConfig::from_env()?;
            cfg.name = name.to_string();
            Machine::open(&cfg)?
        }
    };
    let gpus = match gpu {
        Some(g) if g >= m.gpu_count() => {
            bail!(
                "simulated GPU {g} does not exist (the machine has {})",
                m.gpu_count()
            )
        }
        Some(g) => g..g + 1,
        None => 0..m.gpu_count(),
    };
    for g in gpus {
        let bytes = m.populate(g)?;
        println!(
            "populated {:.1} MiB of simulated GPU {g} of {name}",
            bytes as f64 / (1u64 << 20) as f64
        );
    }
    Ok(())
}

fn status(name: &str, json: bool) -> Result<()> {
    let Some(m) = Machine::open_existing(name)? else {
        if json {
            println!("{{\"name\":{name:?},\"exists\":false,\"gpus\":[]}}");
        } else {
            println!("no simulated machine named {name} (it is created by the first CUDA program)");
        }
        return Ok(());
    };
    let s = m.settings();
    let mut gpus = Vec::new();
    if !json {
        println!(
            "machine {name}: {} GPU(s), PCIe {} GB/s, HBM {} GB/s",
            s.gpus, s.pcie_gbps, s.hbm_gbps
        );
    }
    for g in 0..s.gpus {
        let u = m.usage(g)?;
        let f = m.fault(g)?;
        let uuid = ident::gpu_uuid_string(name, g);
        if json {
            let procs: Vec<String> = u
                .processes
                .iter()
                .map(|p| format!("{{\"pid\":{},\"bytes\":{}}}", p.pid, p.bytes))
                .collect();
            gpus.push(format!(
                "{{\"index\":{g},\"uuid\":\"{uuid}\",\"capacity\":{},\"used\":{},\"peak\":{},\"xid\":{},\"lost\":{},\"processes\":[{}]}}",
                u.capacity,
                u.used,
                u.peak,
                f.xid,
                f.lost,
                procs.join(",")
            ));
        } else {
            let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
            println!(
                "GPU {g} {uuid}: {:.1} MiB used of {:.1} MiB (peak {:.1} MiB){}",
                mib(u.used),
                mib(u.capacity),
                mib(u.peak),
                match (f.xid, f.lost) {
                    (0, _) => String::new(),
                    (x, true) => format!(", LOST (Xid {x})"),
                    (x, false) => format!(", fault Xid {x}"),
                }
            );
            for p in &u.processes {
                println!("  pid {}: {:.1} MiB", p.pid, mib(p.bytes));
            }
        }
    }
    if json {
        println!(
            "{{\"name\":{name:?},\"exists\":true,\"pcie_gbps\":{},\"hbm_gbps\":{},\"gpus\":[{}]}}",
            s.pcie_gbps,
            s.hbm_gbps,
            gpus.join(",")
        );
    }
    Ok(())
}
