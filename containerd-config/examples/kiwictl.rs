//! `kiwictl install|uninstall` with exactly the clap surface this crate gives the
//! real `kiwictl`, as a program: the installer-script test in
//! `tests/deploy_manifests.rs` runs the Helm chart's init-container script with it
//! on PATH, so the script is proven against this crate's real behaviour.

use std::process::ExitCode;

use clap::Parser;
use kiwi_containerd_config::{run_install, run_uninstall, InstallArgs, UninstallArgs};

#[derive(Parser)]
#[command(name = "kiwictl")]
enum Cli {
    /// Register runtime "kiwi" with containerd or docker.
    Install(InstallArgs),
    /// Remove what install added.
    Uninstall(UninstallArgs),
}

fn main() -> ExitCode {
    let result = match Cli::parse() {
        Cli::Install(a) => run_install(&a),
        Cli::Uninstall(a) => run_uninstall(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kiwictl: {e:#}");
            ExitCode::FAILURE
        }
    }
}
