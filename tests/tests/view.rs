//! The arbiter's answer to `view` (issue #39: what NVML tells a process under Kiwi),
//! at the protocol level, with a real arbiter and real sockets: a tenant sees its
//! own clients on a GPU and the memory no swap frees there, never another tenant's
//! clients; a container cannot ask about a GPU it did not claim; a view connection
//! outlives the registration deadline and cannot register.
//!
//! Needs `unshare`, `nsenter` and `setpriv` (`FakeContainer`).

use std::time::Duration;

use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{ArbiterMsg, ClientMsg, ErrorCode, ViewProcess};
use kiwi_tests::{bin, register_msg, wait_until, Arbiter, Client, FakeContainer};

const GIB: u64 = 1 << 30;
const GPU: &str = "GPU-11111111-2222-3333-4444-555555555555";

fn view_conn(socket: &std::path::Path) -> Connection<ClientMsg, ArbiterMsg> {
    let c = Connection::connect(socket).expect("connect");
    c.stream()
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    c
}

fn ask(c: &mut Connection<ClientMsg, ArbiterMsg>, gpu: &str) -> ArbiterMsg {
    c.call(&ClientMsg::View {
        gpu_uuid: gpu.into(),
    })
    .expect("an answer to view")
}

#[test]
fn a_tenant_sees_its_own_clients_and_no_other_tenants() {
    let arb = Arbiter::start(&["--register-timeout-ms", "300"]);
    // This test's process (root on the host: tenant `uid 0`) has a client of 1 GiB,
    // with 100 MiB no swap frees.
    let mut reg = register_msg(GPU, 8 * GIB, GIB);
    reg.unswappable_bytes = Some(100 << 20);
    let _mine = Client::register(&arb.client_socket(), reg);
    // Another tenant: a container's client of 3 GiB on the same GPU.
    let ctr = FakeContainer::start(arb.socket_dir(), "view-other", &[GPU], None);
    let mut other = ctr.command(bin("kiwi-fake-client"));
    other
        .arg("--socket")
        .arg(ctr.socket())
        .args(["--gpu", GPU, "--total", &(8 * GIB).to_string()])
        .args(["--ws", &(3 * GIB).to_string()])
        .stdout(std::process::Stdio::null());
    let mut other = other.spawn().expect("spawn the container's client");
    wait_until("both clients registered", Duration::from_secs(10), || {
        arb.status()
            .gpus
            .iter()
            .map(|g| g.clients.len())
            .sum::<usize>()
            == 2
    });

    let mut v = view_conn(&arb.client_socket());
    match ask(&mut v, GPU) {
        ArbiterMsg::View {
            gpu_uuid,
            known,
            unswappable_bytes,
            processes,
            host,
        } => {
            assert_eq!(gpu_uuid, GPU);
            assert!(known && host);
            assert_eq!(
                processes,
                vec![ViewProcess {
                    pid: std::process::id(),
                    used_bytes: GIB + (100 << 20),
                }],
                "its own client only, with its memory no swap frees"
            );
            // Its 100 MiB, and the reserve standing for the container's client,
            // which reports none: at least what this tenant's client said.
            assert!(unswappable_bytes >= 100 << 20, "{unswappable_bytes}");
            assert!(unswappable_bytes < 3 * GIB, "{unswappable_bytes}");
        }
        other => panic!("{other:?}"),
    }
    // A GPU the arbiter schedules no one on: the driver's figures stand.
    assert!(matches!(
        ask(&mut v, "GPU-none"),
        ArbiterMsg::View { known: false, ref processes, .. } if processes.is_empty()
    ));
    // A view connection is not closed at the registration deadline (300 ms)...
    std::thread::sleep(Duration::from_millis(700));
    assert!(matches!(ask(&mut v, GPU), ArbiterMsg::View { .. }));
    // ...and cannot register.
    let answer = v.call(&ClientMsg::Register(register_msg(GPU, 8 * GIB, GIB)));
    assert!(
        matches!(answer, Ok(ArbiterMsg::Error { code: ErrorCode::InvalidArgument, ref message }) if message.contains("view")),
        "{answer:?}"
    );

    // On the container's socket (root from the host reaches it): a GPU it did not
    // claim is refused, naming nothing of it.
    let key = kiwi_config::containers::key_for("view-other").unwrap();
    let mut c = view_conn(&kiwi_config::containers::container_socket(
        arb.socket_dir(),
        &key,
    ));
    match ask(&mut c, "GPU-unclaimed") {
        ArbiterMsg::Error { code, .. } => assert_eq!(code, ErrorCode::UnknownGpu),
        other => panic!("{other:?}"),
    }
    // A malformed question is refused as such.
    let mut bad = view_conn(&arb.client_socket());
    match ask(&mut bad, "") {
        ArbiterMsg::Error { code, .. } => assert_eq!(code, ErrorCode::InvalidArgument),
        other => panic!("{other:?}"),
    }
    let _ = other.kill();
    let _ = other.wait();
}
