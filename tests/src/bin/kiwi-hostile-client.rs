//! `kiwi-hostile-client`: a tenant that holds arbiter connections open without
//! registering, optionally each in the middle of a large frame. Used by
//! `tests/hostile_conn.rs`, run in a pid namespace of its own (another container).
//!
//! Prints `OPENED <n>` once its connections are open (and their partial frames
//! sent); then, for each line on stdin, `CLOSED <k>`: how many the arbiter has
//! closed by now. Exits when stdin closes.

use std::io::{BufRead, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use kiwi_protocol::{MAGIC, PROTOCOL_VERSION};

#[derive(Parser)]
struct Args {
    /// The arbiter's client socket.
    #[arg(long)]
    socket: PathBuf,
    /// Connections to open.
    #[arg(long)]
    conns: usize,
    /// On each connection, send a header announcing a payload of this many bytes,
    /// and all of it but the last byte.
    #[arg(long)]
    half_frame: Option<usize>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut conns = Vec::with_capacity(args.conns);
    for _ in 0..args.conns {
        let mut s = UnixStream::connect(&args.socket)?;
        if let Some(len) = args.half_frame {
            s.set_write_timeout(Some(Duration::from_secs(5)))?;
            let mut frame = MAGIC.to_vec();
            frame.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
            frame.extend_from_slice(&(len as u32).to_be_bytes());
            frame.resize(8 + len - 1, b' ');
            // The arbiter may refuse the frame and hang up half way: that is fine.
            let _ = s.write_all(&frame);
        }
        s.set_nonblocking(true)?;
        conns.push(s);
    }
    println!("OPENED {}", conns.len());
    std::io::stdout().flush()?;
    let mut buf = [0u8; 4096];
    for line in std::io::stdin().lock().lines() {
        line?;
        let closed = conns
            .iter()
            .filter(|s| loop {
                let mut s: &UnixStream = s;
                match s.read(&mut buf) {
                    Ok(0) => break true,
                    Ok(_) => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
                    Err(_) => break true,
                }
            })
            .count();
        println!("CLOSED {closed}");
        std::io::stdout().flush()?;
    }
    Ok(())
}
