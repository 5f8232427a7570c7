//! The seed's T-marks (T0…T4) found in an event log: where each was, who did what.

use super::*;

/// The seed's marks, where the log shows its pattern. T1: the grant in effect for
/// the first holder A when another client B asks for the GPU; T2: B's request; T3:
/// B's grant, once A's quantum is over (or A released); T4: B's early release (and
/// A's next grant). Returns the marks found, in order (none without a B waiting
/// behind an A). Each GPU is looked at on its own; the first with the pattern wins.
#[cfg(test)]
pub fn seed_marks(events: &[Event]) -> Vec<Mark> {
    seed_marks_from(events, 0)
}

/// [`seed_marks`] for the first B request at or after `from_ns` (A's grant, T1, may
/// be earlier): a window into a long log shows its own occurrence of the pattern.
pub fn seed_marks_from(events: &[Event], from_ns: u64) -> Vec<Mark> {
    let mut gpus: Vec<&str> = Vec::new();
    for e in events {
        if !gpus.contains(&e.gpu.as_str()) {
            gpus.push(&e.gpu);
        }
    }
    let names = short_names(events);
    let name = |id: u64| names.get(&id).cloned().unwrap_or(format!("client {id}"));
    for g in gpus {
        let mut evs: Vec<&Event> = events.iter().filter(|e| e.gpu == g).collect();
        evs.sort_by_key(|e| (e.t_ns, e.seq));
        let marks = seed_marks_one_gpu(&evs, from_ns, &name);
        if !marks.is_empty() {
            return marks;
        }
    }
    Vec::new()
}

fn seed_marks_one_gpu(evs: &[&Event], from_ns: u64, name: &dyn Fn(u64) -> String) -> Vec<Mark> {
    // T1/T2: B requests while A holds.
    let mut holders: BTreeMap<u64, u64> = BTreeMap::new();
    let mut found: Option<(usize, u64, u64, u64)> = None; // (index of T2, A, B, T1)
    for (i, e) in evs.iter().enumerate() {
        let Some(id) = e.client else { continue };
        match e.kind {
            EventKind::Grant { .. } => {
                holders.insert(id, e.t_ns);
            }
            EventKind::Release { .. } | EventKind::Revoke | EventKind::Exit => {
                holders.remove(&id);
            }
            EventKind::Request if e.t_ns >= from_ns => {
                if let Some((&a, &t1)) = holders.iter().find(|(h, _)| **h != id) {
                    found = Some((i, a, id, t1));
                    break;
                }
            }
            _ => {}
        }
    }
    let Some((i2, a, b, t1)) = found else {
        return Vec::new();
    };
    let (na, nb) = (name(a), name(b));
    let mut marks = vec![
        Mark {
            label: "T1".into(),
            t_ns: t1,
            note: format!("{na} gets the GPU"),
        },
        Mark {
            label: "T2".into(),
            t_ns: evs[i2].t_ns,
            note: format!("{nb} asks for the GPU and waits"),
        },
    ];
    // T3: B's grant; how A let go decides the words.
    let mut a_dropped_for_tq = false;
    let mut a_released_early = false;
    let mut i3 = None;
    for (i, e) in evs.iter().enumerate().skip(i2 + 1) {
        match (e.client, &e.kind) {
            (
                Some(c),
                EventKind::Drop {
                    reason: DropReason::TqExpired,
                    ..
                },
            ) if c == a => a_dropped_for_tq = true,
            (Some(c), EventKind::Release { early, .. }) if c == a => a_released_early = *early,
            (Some(c), EventKind::Grant { .. }) if c == b => {
                i3 = Some(i);
                break;
            }
            (Some(c), EventKind::Exit) if c == b => break,
            _ => {}
        }
    }
    let Some(i3) = i3 else { return marks };
    let t3 = evs[i3].t_ns;
    // Did A ask again right away (it still had GPU work, like the seed's A)?
    let a_waits = evs
        .iter()
        .skip(i2 + 1)
        .filter(|e| e.client == Some(a))
        .take_while(|e| e.t_ns <= t3 + NS_PER_S / 10)
        .any(|e| matches!(e.kind, EventKind::Request));
    let why = if a_dropped_for_tq && !a_released_early {
        format!("{na}'s time quantum is over")
    } else {
        format!("{na} releases the GPU")
    };
    marks.push(Mark {
        label: "T3".into(),
        t_ns: t3,
        note: if a_waits {
            format!("{why}: {nb} gets the GPU, {na} waits")
        } else {
            format!("{why}: {nb} gets the GPU")
        },
    });
    // T4: B gives the GPU back before its quantum is over.
    for (i, e) in evs.iter().enumerate().skip(i3 + 1) {
        if e.client != Some(b) {
            continue;
        }
        match e.kind {
            EventKind::Release { early: true, .. } => {
                let a_next = evs[i + 1..]
                    .iter()
                    .find(|x| matches!(x.kind, EventKind::Grant { .. }))
                    .is_some_and(|x| x.client == Some(a));
                marks.push(Mark {
                    label: "T4".into(),
                    t_ns: e.t_ns,
                    note: if a_next {
                        format!("{nb} releases early: {na} gets the GPU again")
                    } else {
                        format!("{nb} releases early")
                    },
                });
                break;
            }
            EventKind::Release { .. } | EventKind::Revoke | EventKind::Exit => break,
            _ => {}
        }
    }
    marks
}
