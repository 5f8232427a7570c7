use serde::{Deserialize, Serialize};

use super::*;

#[test]
fn wire_shape_is_documented_shape() {
    let j = serde_json::to_string(&ClientMsg::Request).unwrap();
    assert_eq!(j, r#"{"type":"request"}"#);
    let j = serde_json::to_string(&ClientMsg::Release(Usage {
        working_set_bytes: 10,
        resident_bytes: 4,
    }))
    .unwrap();
    assert_eq!(
        j,
        r#"{"type":"release","working_set_bytes":10,"resident_bytes":4}"#
    );
    let j = serde_json::to_string(&ArbiterMsg::Grant {
        exclusive: true,
        tq_ms: 30000,
        waiting: 1,
        pipelined: false,
        group: false,
    })
    .unwrap();
    assert_eq!(
        j,
        r#"{"type":"grant","exclusive":true,"tq_ms":30000,"waiting":1}"#
    );
    let j = serde_json::to_string(&ArbiterMsg::Grant {
        exclusive: true,
        tq_ms: 300,
        waiting: 0,
        pipelined: false,
        group: true,
    })
    .unwrap();
    assert_eq!(
        j,
        r#"{"type":"grant","exclusive":true,"tq_ms":300,"waiting":0,"group":true}"#
    );
}

#[test]
fn register_minimal_and_unknown_fields() {
    let m: ClientMsg = serde_json::from_str(
        r#"{"type":"register","version":1,"pid":7,"gpu_uuid":"GPU-1","gpu_total_memory":1024}"#,
    )
    .unwrap();
    match m {
        ClientMsg::Register(r) => {
            assert_eq!(r.pid, 7);
            assert_eq!(r.working_set_bytes, 0);
            assert!(r.resume.is_none());
        }
        other => panic!("{other:?}"),
    }
    assert!(
        serde_json::from_str::<ClientMsg>(r#"{"type":"set_scheduler","on":false,"gpu":null}"#)
            .is_err()
    );
    assert!(serde_json::from_str::<ControlRequest>(
        r#"{"type":"set_scheduler","on":false,"gpu":null}"#
    )
    .is_ok());
}

/// A registration without `unswappable_bytes` is what older shims send; one with
/// it (even 0) opts in to `unswappable` reports, which older arbiters refuse.
#[test]
fn unswappable_is_opt_in_and_additive() {
    let base =
        r#"{"type":"register","version":1,"pid":7,"gpu_uuid":"GPU-1","gpu_total_memory":1024"#;
    let old: ClientMsg = serde_json::from_str(&format!("{base}}}")).unwrap();
    let ClientMsg::Register(mut r) = old else {
        panic!("not a registration")
    };
    assert_eq!(r.unswappable_bytes, None);
    assert!(!serde_json::to_string(&ClientMsg::Register(r.clone()))
        .unwrap()
        .contains("unswappable"));
    r.unswappable_bytes = Some(0);
    let j = serde_json::to_string(&ClientMsg::Register(r.clone())).unwrap();
    assert!(j.contains(r#""unswappable_bytes":0"#), "{j}");
    assert_eq!(
        round_trip(&ClientMsg::Register(r.clone())),
        ClientMsg::Register(r)
    );
    let m = ClientMsg::Unswappable { bytes: 300 << 20 };
    assert_eq!(
        serde_json::to_string(&m).unwrap(),
        r#"{"type":"unswappable","bytes":314572800}"#
    );
    assert_eq!(round_trip(&m), m);
    assert!(serde_json::from_str::<ClientMsg>(r#"{"type":"unswappable"}"#).is_err());
    assert!(
        serde_json::from_str::<ClientMsg>(r#"{"type":"unswappable","bytes":1,"x":2}"#).is_err()
    );
}

fn round_trip<T>(msg: &T) -> T
where
    T: Serialize + serde::de::DeserializeOwned,
{
    let bytes = crate::encode(msg).unwrap();
    let mut d = crate::FrameDecoder::new();
    d.push(&bytes);
    d.next_msg::<T>().unwrap().unwrap()
}

#[test]
fn swap_admission_messages_round_trip() {
    let admit = ClientMsg::Admit {
        working_set_bytes: 800 << 20,
    };
    assert_eq!(
        serde_json::to_string(&admit).unwrap(),
        r#"{"type":"admit","working_set_bytes":838860800}"#
    );
    assert_eq!(round_trip(&admit), admit);

    let admitted = ArbiterMsg::Admitted {
        ok: false,
        swap_needed_bytes: 123,
        swap_budget_bytes: u64::MAX,
        message: None,
    };
    assert_eq!(
        serde_json::to_string(&admitted).unwrap(),
        r#"{"type":"admitted","ok":false,"swap_needed_bytes":123,"swap_budget_bytes":18446744073709551615}"#
    );
    assert_eq!(round_trip(&admitted), admitted);
    // Every field is required; unknown ones are refused.
    assert!(serde_json::from_str::<ArbiterMsg>(r#"{"type":"admitted","ok":true}"#).is_err());
    assert!(serde_json::from_str::<ClientMsg>(r#"{"type":"admit"}"#).is_err());
    assert!(serde_json::from_str::<ClientMsg>(
        r#"{"type":"admit","working_set_bytes":1,"resident_bytes":0}"#
    )
    .is_err());
}

#[test]
fn registered_carries_the_budget_only_when_set() {
    let settings = Settings {
        scheduler_on: true,
        tq_ms: 30_000,
    };
    let none = ArbiterMsg::Registered {
        client_id: 3,
        settings,
        capacity_bytes: 896 << 20,
        swap_budget_bytes: None,
    };
    let j = serde_json::to_string(&none).unwrap();
    assert!(!j.contains("swap_budget_bytes"), "{j}");
    assert_eq!(round_trip(&none), none);

    let some = ArbiterMsg::Registered {
        client_id: 3,
        settings,
        capacity_bytes: 896 << 20,
        swap_budget_bytes: Some(100 << 20),
    };
    let j = serde_json::to_string(&some).unwrap();
    assert!(j.contains(r#""swap_budget_bytes":104857600"#), "{j}");
    assert_eq!(round_trip(&some), some);

    // What an arbiter without the field sends still decodes.
    let old: ArbiterMsg = serde_json::from_str(
        r#"{"type":"registered","client_id":3,"settings":{"scheduler_on":true,"tq_ms":30000},"capacity_bytes":939524096}"#,
    )
    .unwrap();
    assert_eq!(old, none);
}

/// `bounds` is opt-in: a registration without it is what older shims send, and
/// `bounds` (a message older shims cannot decode) goes only to those that asked.
#[test]
fn bounds_are_opt_in_and_round_trip() {
    let old =
        r#"{"type":"register","version":1,"pid":7,"gpu_uuid":"GPU-1","gpu_total_memory":1024}"#;
    let ClientMsg::Register(mut r) = serde_json::from_str::<ClientMsg>(old).unwrap() else {
        panic!("not a register");
    };
    assert!(!r.bounds);
    assert!(!serde_json::to_string(&ClientMsg::Register(r.clone()))
        .unwrap()
        .contains("bounds"));
    r.bounds = true;
    let j = serde_json::to_string(&ClientMsg::Register(r.clone())).unwrap();
    assert!(j.ends_with(r#","bounds":true}"#), "{j}");
    assert_eq!(
        round_trip(&ClientMsg::Register(r.clone())),
        ClientMsg::Register(r)
    );

    let b = ArbiterMsg::Bounds { hint_wait_ms: 200 };
    assert_eq!(
        serde_json::to_string(&b).unwrap(),
        r#"{"type":"bounds","hint_wait_ms":200}"#
    );
    assert_eq!(round_trip(&b), b);
    let max = ArbiterMsg::Bounds {
        hint_wait_ms: u64::MAX,
    };
    assert_eq!(round_trip(&max), max);
    // The bound is required; unknown fields are refused.
    assert!(serde_json::from_str::<ArbiterMsg>(r#"{"type":"bounds"}"#).is_err());
    assert!(serde_json::from_str::<ArbiterMsg>(
        r#"{"type":"bounds","hint_wait_ms":1,"idle_ms":2}"#
    )
    .is_err());
}

#[test]
fn wait_info_is_opt_in_and_waiting_round_trips() {
    // A registration without the opt-in is what older shims send, and decodes.
    let old =
        r#"{"type":"register","version":1,"pid":7,"gpu_uuid":"GPU-1","gpu_total_memory":1024}"#;
    let ClientMsg::Register(mut r) = serde_json::from_str::<ClientMsg>(old).unwrap() else {
        panic!("not a register");
    };
    assert!(!r.wait_info);
    assert!(!serde_json::to_string(&ClientMsg::Register(r.clone()))
        .unwrap()
        .contains("wait_info"));
    r.wait_info = true;
    let j = serde_json::to_string(&ClientMsg::Register(r.clone())).unwrap();
    assert!(j.ends_with(r#","wait_info":true}"#), "{j}");
    assert_eq!(
        round_trip(&ClientMsg::Register(r.clone())),
        ClientMsg::Register(r)
    );

    let w = ArbiterMsg::Waiting {
        holder: Some("nb-a".into()),
        other_holders: 0,
        ahead: 1,
        quantum_left_ms: Some(12_000),
    };
    assert_eq!(
        serde_json::to_string(&w).unwrap(),
        r#"{"type":"waiting","holder":"nb-a","ahead":1,"quantum_left_ms":12000}"#
    );
    assert_eq!(round_trip(&w), w);
    let bare: ArbiterMsg = serde_json::from_str(r#"{"type":"waiting","ahead":0}"#).unwrap();
    assert_eq!(
        bare,
        ArbiterMsg::Waiting {
            holder: None,
            other_holders: 0,
            ahead: 0,
            quantum_left_ms: None
        }
    );
    // Why it must be opt-in: a shim that predates the type cannot decode it.
    #[derive(Deserialize)]
    #[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
    #[allow(dead_code)]
    enum OldArbiterMsg {
        Pong { token: u64 },
    }
    assert!(serde_json::from_str::<OldArbiterMsg>(r#"{"type":"waiting","ahead":0}"#).is_err());
}

#[test]
fn status_report_swap_fields_default() {
    let old: StatusReport = serde_json::from_str(
        r#"{"default_settings":{"scheduler_on":true,"tq_ms":30000},"gpus":[],"now_ns":5}"#,
    )
    .unwrap();
    assert_eq!(old.swap_budget_bytes, None);
    assert_eq!(old.swap_need_bytes, 0);
    assert_eq!(old.swap_in_use_bytes, 0);
    assert_eq!(old.omitted_clients, 0);
    assert!(!serde_json::to_string(&old).unwrap().contains("omitted"));
    let r = StatusReport {
        omitted_clients: 3,
        swap_budget_bytes: Some(1 << 30),
        swap_need_bytes: 7,
        swap_in_use_bytes: 9,
        ..old
    };
    let back: StatusReport = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
    assert_eq!(back, r);
}

/// #15's additions to the control side are optional both ways: what older
/// arbiters send decodes, and defaults are left out.
#[test]
fn idle_eviction_fields_are_additive() {
    let old: EventKind = serde_json::from_str(r#"{"event":"reclaim","need_bytes":5}"#).unwrap();
    assert_eq!(
        old,
        EventKind::Reclaim {
            need_bytes: 5,
            idle: false
        }
    );
    assert_eq!(
        serde_json::to_string(&old).unwrap(),
        r#"{"event":"reclaim","need_bytes":5}"#
    );
    let idle = EventKind::Reclaim {
        need_bytes: 5,
        idle: true,
    };
    assert_eq!(
        serde_json::to_string(&idle).unwrap(),
        r#"{"event":"reclaim","need_bytes":5,"idle":true}"#
    );
    let c: ClientStatus = serde_json::from_str(
        r#"{"id":1,"pid":2,"host_pid":3,"name":null,"container_id":null,"pod_name":null,"pod_namespace":null,"state":"idle","working_set_bytes":0,"resident_bytes":0,"swapped_bytes":0,"waited_ns":0,"held_ns":0}"#,
    )
    .unwrap();
    assert_eq!(c.idle_since_ns, None);
    assert!(!serde_json::to_string(&c).unwrap().contains("idle_since"));
}

#[test]
fn client_text_is_bounded_and_printable() {
    let mut r = Register {
        pod_name: Some("p".repeat(MAX_TEXT_BYTES)),
        name: Some("jupyter-ü".into()),
        ..Register::new("GPU-1", 1 << 30, 0)
    };
    assert_eq!(r.validate(), Ok(()));
    r.name = Some("x".repeat(1 << 20));
    let e = r.validate().unwrap_err();
    assert_eq!(e.field, "name");
    assert_eq!(
        e.to_string(),
        "field `name` is 1048576 bytes long; the limit is 253"
    );
    r.name = Some("ok\n[INFO] forged".into());
    let e = ClientMsg::Register(r.clone()).validate().unwrap_err();
    assert_eq!(
        e.to_string(),
        "field `name` contains the control character U+000A"
    );
    r.name = None;
    for bad in ["a\rb", "\u{1b}[2J", "a\u{2028}b", "\u{202e}gpj", "\u{85}"] {
        r.container_id = Some(bad.into());
        assert_eq!(r.validate().unwrap_err().field, "container_id", "{bad:?}");
    }
    r.container_id = None;
    r.gpu_uuid = String::new();
    assert_eq!(r.validate().unwrap_err().field, "gpu_uuid");
    let sel = ControlRequest::Status {
        gpu: Some("0\n".into()),
    };
    assert_eq!(sel.validate().unwrap_err().field, "gpu");
}
