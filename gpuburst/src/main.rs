//! `gpuburst`: see the crate docs. Exit codes: 0 ok, 1 bad usage, bad input or no driver,
//! 2 a CUDA call failed (the call and error name are printed), 3 verification failed,
//! 4 an `--exchange` step did not finish within `--exchange-timeout-ms`, or an `--ipc`
//! peer did not come (the importer) or close (the exporter) within `--ipc-timeout-ms`.

use gpuburst::burst::{run, Failure, Options};
use gpuburst::driver::Cuda;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match Options::parse(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("gpuburst: {e}");
            std::process::exit(1);
        }
    };
    let cuda = match Cuda::load() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpuburst: {e}");
            std::process::exit(1);
        }
    };
    match run(&cuda, &opts) {
        Ok(()) => {}
        Err(Failure::Cuda(e)) => {
            eprintln!("gpuburst [{}]: {e}", opts.name);
            std::process::exit(2);
        }
        Err(Failure::Input(m)) => {
            eprintln!("gpuburst [{}]: {m}", opts.name);
            std::process::exit(1);
        }
        Err(Failure::Mismatch(m)) => {
            eprintln!("gpuburst [{}]: verification failed: {m}", opts.name);
            std::process::exit(3);
        }
        Err(Failure::Timeout(m)) => {
            eprintln!("gpuburst [{}]: {m}", opts.name);
            std::process::exit(4);
        }
    }
}
