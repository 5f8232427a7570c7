//! Which bytes of a segment are dead: the ranges an application declared with
//! `kiwiMemDiscard` (issue #26), each valid only under the submission token it was
//! declared at. A swap-out copies only the live pieces of a segment; a segment with
//! no live byte needs no copy and no host buffer at all.
//!
//! The token is the process's count of work submissions (any kernel or copy could
//! write a dead range, so any submission voids every discard): a discard made at token
//! `t` holds while the token is still `t`. A mark with another token is stale and
//! reads as "everything live", so a stale hint can never lose data.
//!
//! Pure arithmetic, no driver: a leaf anyone may use.

/// Most dead ranges a segment keeps. A further one that does not merge with the
/// others is ignored (ignoring a discard is always safe: the bytes are copied), so an
/// application cannot make the shim hold an unbounded list.
pub const MAX_RANGES: usize = 64;

/// The dead ranges of one segment: (offset, length) relative to its start, sorted,
/// disjoint, non-adjacent, and the token they were declared at.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Dead {
    token: u64,
    ranges: Vec<(u64, u64)>,
}

impl Dead {
    /// Declares `[off, off + len)` dead at `token`. Marks of another token are stale:
    /// dropped first. Returns whether the range was recorded (false: the list is full).
    pub fn add(&mut self, token: u64, off: u64, len: u64) -> bool {
        if token != self.token {
            self.ranges.clear();
            self.token = token;
        }
        if len == 0 {
            return true;
        }
        let (mut start, mut end) = (off, off.saturating_add(len));
        // Merge every range that overlaps or touches the new one.
        let mut kept = Vec::with_capacity(self.ranges.len() + 1);
        for &(o, l) in &self.ranges {
            let (s, e) = (o, o + l);
            if e < start || s > end {
                kept.push((o, l));
            } else {
                start = start.min(s);
                end = end.max(e);
            }
        }
        if kept.len() >= MAX_RANGES {
            return false;
        }
        let at = kept.partition_point(|&(o, _)| o < start);
        kept.insert(at, (start, end - start));
        self.ranges = kept;
        true
    }

    /// Forgets every mark (the segment's contents were replaced).
    pub fn clear(&mut self) {
        self.ranges.clear();
    }

    /// The pieces of a segment of `size` bytes that must be copied at `token`: the
    /// complement of the dead ranges when they were declared at `token`, else the
    /// whole segment.
    pub fn live_pieces(&self, token: Option<u64>, size: u64) -> Vec<(u64, u64)> {
        if token != Some(self.token) || self.ranges.is_empty() {
            return vec![(0, size)];
        }
        let mut pieces = Vec::with_capacity(self.ranges.len() + 1);
        let mut at = 0;
        for &(o, l) in &self.ranges {
            let o = o.min(size);
            if o > at {
                pieces.push((at, o - at));
            }
            at = at.max((o + l).min(size));
        }
        if at < size {
            pieces.push((at, size - at));
        }
        pieces
    }

    /// Bytes [`Dead::live_pieces`] would copy.
    pub fn live_bytes(&self, token: Option<u64>, size: u64) -> u64 {
        self.live_pieces(token, size).iter().map(|p| p.1).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_mark_of_another_token_is_stale() {
        let mut d = Dead::default();
        assert!(d.add(7, 0, 100));
        assert_eq!(d.live_pieces(Some(7), 100), vec![]);
        assert_eq!(d.live_pieces(Some(8), 100), vec![(0, 100)]);
        assert_eq!(d.live_pieces(None, 100), vec![(0, 100)]);
        // A new token drops the old marks.
        assert!(d.add(8, 10, 10));
        assert_eq!(d.live_pieces(Some(8), 100), vec![(0, 10), (20, 80)]);
    }

    #[test]
    fn ranges_merge_and_the_list_is_bounded() {
        let mut d = Dead::default();
        for k in 0..MAX_RANGES as u64 {
            assert!(d.add(1, k * 10, 5));
        }
        // Disjoint from all: refused, nothing lost.
        assert!(!d.add(1, 10_000, 5));
        assert_eq!(
            d.live_bytes(Some(1), 10_000),
            10_000 - 5 * MAX_RANGES as u64
        );
        // Touching two neighbours merges them: accepted.
        assert!(d.add(1, 5, 5));
        assert_eq!(d.live_pieces(Some(1), 30)[0], (15, 5));
    }

    proptest! {
        /// The live pieces are exactly the bytes no mark of the current token covers.
        #[test]
        fn live_pieces_are_the_complement(marks in proptest::collection::vec((0u64..200, 0u64..60), 0..20)) {
            let size = 200;
            let mut d = Dead::default();
            let mut dead = [false; 200];
            for &(o, l) in &marks {
                if d.add(3, o, l) {
                    for b in o..(o + l).min(size) {
                        dead[b as usize] = true;
                    }
                }
            }
            let mut live = [false; 200];
            for (o, l) in d.live_pieces(Some(3), size) {
                prop_assert!(l > 0 && o + l <= size);
                for b in o..o + l {
                    prop_assert!(!live[b as usize], "pieces overlap");
                    live[b as usize] = true;
                }
            }
            for b in 0..size as usize {
                prop_assert_eq!(live[b], !dead[b], "byte {}", b);
            }
        }
    }
}
