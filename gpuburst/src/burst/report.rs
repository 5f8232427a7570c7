//! What gpuburst prints: one line per event, human (`[name] ...`) or JSON
//! (`--json`), flushed at once. The `ready`, `phase`, `verify` and `end` lines are
//! written here; a step writes its `burst` line ([`super::step`]).

use std::time::Instant;

use crate::exchange::{self, Exchange};
use crate::ipc::{self, Role};
use crate::memory::AllocMode;

use super::Options;

/// Output sink: human lines or JSON lines.
pub(super) struct Report {
    json: bool,
    name: String,
    t0: Instant,
}

impl Report {
    /// A report for `o`'s program, its times counted from now.
    pub(super) fn new(o: &Options) -> Report {
        Report {
            json: o.json,
            name: o.name.clone(),
            t0: Instant::now(),
        }
    }

    /// Milliseconds since the program started.
    pub(super) fn ms(&self) -> f64 {
        self.t0.elapsed().as_secs_f64() * 1e3
    }

    pub(super) fn line(&self, human: String, json: String) {
        if self.json {
            println!("{json}");
        } else {
            println!("[{}] {human}", self.name);
        }
        use std::io::Write;
        let _ = std::io::stdout().flush();
    }

    /// The `ready` line: the memory is allocated and filled on `devices` devices
    /// (`ordinals`), in `allocations` allocations, the exchange and the IPC pair set up.
    pub(super) fn ready(
        &self,
        o: &Options,
        devices: usize,
        ex: Option<&Exchange>,
        shared: Option<&ipc::Published>,
        allocations: usize,
        ordinals: &str,
    ) {
        let pid = std::process::id();
        let human_devices = if devices > 1 {
            format!(" on each of devices {ordinals}")
        } else {
            String::new()
        };
        let (human_exchange, json_exchange) = match ex {
            Some(x) => {
                let ranks = (0..devices)
                    .map(|i| x.rank_of(i).to_string())
                    .collect::<Vec<_>>()
                    .join(",");
                (
                    format!(", exchange rank {ranks} via {}", x.file.path().display()),
                    format!(",\"exchange_ranks\":[{ranks}]"),
                )
            }
            None => (String::new(), String::new()),
        };
        let (human_ipc, json_ipc) = match (&o.ipc, shared) {
            (Some(spec), Some(p)) => {
                let human = match spec.role {
                    Role::Export => format!(", {} bytes exported", p.bytes),
                    Role::Import => format!(", {} bytes imported from pid {}", p.bytes, p.pid),
                };
                (
                    format!("{human} via {}", spec.path.display()),
                    format!(
                        ",\"ipc\":\"{}\",\"ipc_bytes\":{},\"ipc_exporter_pid\":{}",
                        spec.role.name(),
                        p.bytes,
                        p.pid
                    ),
                )
            }
            _ => (String::new(), String::new()),
        };
        let human_alloc = match o.alloc {
            AllocMode::Device => String::new(),
            m => format!(" ({})", m.name()),
        };
        self.line(
            format!(
                "ready: pid {pid}, {} bytes{human_alloc}{human_devices} in {allocations} allocations{human_exchange}{human_ipc}, at {:.1} ms",
                o.mem,
                self.ms()
            ),
            format!(
                "{{\"event\":\"ready\",\"name\":\"{}\",\"pid\":{pid},\"mem_bytes\":{},\"alloc\":\"{}\",\"allocations\":{allocations},\"t_ms\":{:.3},\"devices\":{},\"device_ordinals\":[{ordinals}]{json_exchange}{json_ipc}}}",
                o.name,
                o.mem,
                o.alloc.name(),
                self.ms(),
                devices
            ),
        );
    }

    /// A `phase` line (JSON only): a phase of `kind` ran from `start_ns` to now.
    pub(super) fn phase(&self, kind: &str, start_ns: u64) {
        if self.json {
            self.line(
                String::new(),
                format!(
                    "{{\"event\":\"phase\",\"name\":\"{}\",\"kind\":\"{}\",\"start_ns\":{start_ns},\"end_ns\":{}}}",
                    self.name,
                    kind,
                    super::monotonic_ns()
                ),
            );
        }
    }

    /// The `verify` line: `allocations` allocations on `devices` devices (`ordinals`)
    /// were verified, all as expected or not (`ok`).
    pub(super) fn verified(&self, allocations: usize, devices: usize, ordinals: &str, ok: bool) {
        self.line(
            format!(
                "verify: {allocations} allocations{}, {}",
                if devices > 1 {
                    format!(" on devices {ordinals}")
                } else {
                    String::new()
                },
                if ok {
                    "all bytes as expected"
                } else {
                    "MISMATCH"
                }
            ),
            format!(
                "{{\"event\":\"verify\",\"name\":\"{}\",\"ok\":{ok},\"allocations\":{allocations},\"devices\":{}}}",
                self.name,
                devices
            ),
        );
    }

    /// The `end` line: the total time and each step's (`step_ms`); the steps'
    /// percentiles in the human line only with `--exchange`.
    pub(super) fn end(&self, exchange: bool, step_ms: &[f64]) {
        let p50 = exchange::percentile(step_ms, 50.0);
        let max = exchange::percentile(step_ms, 100.0);
        let json_ms = |v: Option<f64>| v.map_or("null".to_string(), |v| format!("{v:.3}"));
        let human_steps = match (exchange, p50, max) {
            (true, Some(p50), Some(max)) => {
                format!(
                    ", {} steps: p50 {p50:.1} ms, max {max:.1} ms",
                    step_ms.len()
                )
            }
            _ => String::new(),
        };
        self.line(
            format!("done in {:.1} ms{human_steps}", self.ms()),
            format!(
                "{{\"event\":\"end\",\"name\":\"{}\",\"total_ms\":{:.3},\"step_ms\":[{}],\"step_p50_ms\":{},\"step_max_ms\":{}}}",
                self.name,
                self.ms(),
                step_ms
                    .iter()
                    .map(|v| format!("{v:.3}"))
                    .collect::<Vec<_>>()
                    .join(","),
                json_ms(p50),
                json_ms(max)
            ),
        );
    }
}
