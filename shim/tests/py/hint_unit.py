"""Unit tests of the `kiwi` package's discard hint (python/kiwi, issue #26), run by
shim/tests/hint_py.rs with plain python3 (unittest), without the shim, torch or a GPU.

The snapshot fixture is written from PyTorch's documented format, not taken from a
real run (CI has neither torch nor a GPU): the segment/block dicts that
torch.cuda.memory_snapshot() returns, documented in the docstring of
torch.cuda.memory._snapshot (torch/cuda/memory.py) and in "Understanding CUDA Memory
Usage"; block "address" and segment "is_expandable" only in newer versions (older
blocks tile their segment in order, so their address is implied)."""

import io
import sys
import threading
import types
import unittest

import kiwi

MIB = 1 << 20
A = 0x7F0000000000  # a large segment, new format (blocks carry their address)
B = 0x7F0040000000  # a large segment, old format (no block address)
C = 0x7F0080000000  # an expandable segment
D = 0x7F00C0000000  # a small segment (2 MiB) split into 4 free blocks
E = 0x7F0100000000  # a malformed one: its last block runs past the segment


def block(state, size, address=None):
    b = {"size": size, "requested_size": size, "state": state, "frames": []}
    if address is not None:
        b["address"] = address
    return b


def segment(address, blocks, expandable=None, small=False):
    s = {
        "device": 0,
        "address": address,
        "total_size": sum(b["size"] for b in blocks),
        "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
        "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
        "requested_size": 0,
        "stream": 0,
        "segment_type": "small" if small else "large",
        "segment_pool_id": (0, 0),
        "frames": [],
        "blocks": blocks,
    }
    if expandable is not None:
        s["is_expandable"] = expandable
    return s


SNAPSHOT = [
    segment(
        A,
        [
            block("active_allocated", 2 * MIB, A),
            block("inactive", 4 * MIB, A + 2 * MIB),
            block("inactive", 6 * MIB, A + 6 * MIB),  # adjacent: one range of 10 MiB
            block("active_pending_free", 2 * MIB, A + 12 * MIB),
            block("inactive", 6 * MIB, A + 14 * MIB),
        ],
        expandable=False,
    ),
    segment(
        B,
        [
            block("inactive", 1 * MIB),
            block("active_allocated", 1 * MIB),
            block("inactive", 2 * MIB),
            block("inactive", 1 * MIB),  # with the one before: 3 MiB at B + 2 MiB
            block("active_allocated", 8 * MIB),
            block("inactive", 20 * MIB),  # at B + 13 MiB
        ],
    ),
    segment(
        C,
        [block("inactive", 32 * MIB, C), block("active_allocated", 2 * MIB, C + 32 * MIB)],
        expandable=True,
    ),
    segment(D, [block("inactive", MIB // 2, D + k * MIB // 2) for k in range(4)], small=True),
    segment(E, [block("active_allocated", 2 * MIB, E), block("inactive", 2 * MIB, E + 4 * MIB)]),
]


class FakeCuda(types.ModuleType):
    def __init__(self, initialized=True, new_signature=True, raises=None):
        super().__init__("torch.cuda")
        self.initialized = initialized
        self.new_signature = new_signature
        self.raises = raises
        self.calls = []

    def is_initialized(self):
        return self.initialized

    def memory_snapshot(self, *args, **kwargs):
        self.calls.append(kwargs)
        if kwargs and not self.new_signature:
            raise TypeError("memory_snapshot() got an unexpected keyword argument 'include_traces'")
        if self.raises is not None:
            raise self.raises
        return SNAPSHOT


class FakeTorch:
    """Installs a fake `torch` in sys.modules for the duration of a with block."""

    def __init__(self, cuda):
        self.torch = types.ModuleType("torch")
        self.torch.cuda = cuda

    def __enter__(self):
        self.saved = sys.modules.get("torch")
        sys.modules["torch"] = self.torch
        kiwi._snapshot_kwargs = {"include_traces": False}
        return self.torch

    def __exit__(self, *exc):
        if self.saved is None:
            sys.modules.pop("torch", None)
        else:
            sys.modules["torch"] = self.saved


class TorchDeadRanges(unittest.TestCase):
    def test_only_inactive_runs_merged_per_segment_largest_first(self):
        got = kiwi.torch_dead_ranges(SNAPSHOT)
        want = [
            (B + 13 * MIB, 20 * MIB),
            (A + 2 * MIB, 10 * MIB),
            (A + 14 * MIB, 6 * MIB),
            (B + 2 * MIB, 3 * MIB),
            (D, 2 * MIB),
            (B, 1 * MIB),
        ]
        self.assertEqual(got, want)

    def test_expandable_segments_are_skipped(self):
        self.assertFalse([r for r in kiwi.torch_dead_ranges(SNAPSHOT) if C <= r[0] < C + 64 * MIB])

    def test_active_and_pending_blocks_are_never_dead(self):
        for addr, size in kiwi.torch_dead_ranges(SNAPSHOT):
            for seg in SNAPSHOT:
                cursor = seg["address"]
                for b in seg["blocks"]:
                    start = b.get("address", cursor)
                    cursor = start + b["size"]
                    if b["state"] != "inactive":
                        self.assertTrue(
                            addr + size <= start or cursor <= addr,
                            "range %x+%d overlaps a %s block" % (addr, size, b["state"]),
                        )

    def test_a_block_past_its_segment_is_left_out(self):
        self.assertFalse([r for r in kiwi.torch_dead_ranges(SNAPSHOT) if E <= r[0] < E + 64 * MIB])

    def test_min_bytes(self):
        got = kiwi.torch_dead_ranges(SNAPSHOT, min_bytes=3 * MIB)
        self.assertEqual([s for _, s in got], [20 * MIB, 10 * MIB, 6 * MIB, 3 * MIB])

    def test_empty_and_malformed_input(self):
        self.assertEqual(kiwi.torch_dead_ranges(None), [])
        self.assertEqual(kiwi.torch_dead_ranges([]), [])
        self.assertEqual(kiwi.torch_dead_ranges([{"blocks": []}, {"address": "x"}, 7]), [])


class TorchSource(unittest.TestCase):
    def test_without_torch_nothing_and_torch_is_not_imported(self):
        sys.modules.pop("torch", None)
        self.assertIsNone(kiwi._torch_segments())
        self.assertEqual(kiwi._dead_ranges(), [])
        self.assertNotIn("torch", sys.modules)

    def test_cuda_not_initialized_no_snapshot(self):
        cuda = FakeCuda(initialized=False)
        with FakeTorch(cuda):
            self.assertIsNone(kiwi._torch_segments())
        self.assertEqual(cuda.calls, [])

    def test_a_torch_without_cuda_attributes(self):
        with FakeTorch(types.ModuleType("torch.cuda")):
            self.assertIsNone(kiwi._torch_segments())

    def test_lightweight_snapshot_where_accepted(self):
        cuda = FakeCuda(new_signature=True)
        with FakeTorch(cuda):
            self.assertEqual(kiwi._torch_segments(), SNAPSHOT)
            kiwi._torch_segments()
        self.assertEqual(cuda.calls, [{"include_traces": False}] * 2)

    def test_older_torch_plain_snapshot(self):
        cuda = FakeCuda(new_signature=False)
        with FakeTorch(cuda):
            self.assertEqual(kiwi._torch_segments(), SNAPSHOT)
            kiwi._torch_segments()
        self.assertEqual(cuda.calls, [{"include_traces": False}, {}, {}])

    def test_dead_ranges_skip_small_ones(self):
        with FakeTorch(FakeCuda()):
            got = kiwi._dead_ranges()
        self.assertEqual(got, kiwi.torch_dead_ranges(SNAPSHOT, kiwi.MIN_DEAD_BYTES))
        self.assertNotIn((D, MIB // 2), got)


class Answer(unittest.TestCase):
    def setUp(self):
        with kiwi._stats_lock:
            for k in kiwi._stats:
                kiwi._stats[k] = 0
        self.discarded = []
        self.done = []

    def discard(self, addr, size):
        self.discarded.append((addr, size))
        return 1 if addr == B else 0  # refuses one: CUDA_ERROR_INVALID_VALUE

    def test_discards_each_range_then_done_refusals_counted(self):
        with FakeTorch(FakeCuda()):
            kiwi._answer(42, self.done.append, self.discard)
        want = kiwi.torch_dead_ranges(SNAPSHOT, kiwi.MIN_DEAD_BYTES)
        self.assertEqual(self.discarded, want)
        self.assertEqual(self.done, [42])
        s = kiwi.hint_stats()
        self.assertEqual(s["answered"], 1)
        self.assertEqual(s["refused"], 1)
        self.assertEqual(s["ranges"], len(want) - 1)
        self.assertEqual(s["bytes"], sum(n for a, n in want if a != B))
        self.assertGreaterEqual(s["seconds_last"], 0.0)

    def test_a_failing_source_still_answers(self):
        with FakeTorch(FakeCuda(raises=RuntimeError("snapshot failed"))):
            kiwi._answer(7, self.done.append, self.discard)
        self.assertEqual(self.done, [7])
        self.assertEqual(self.discarded, [])
        s = kiwi.hint_stats()
        self.assertEqual((s["answered"], s["errors"], s["ranges"]), (1, 1, 0))

    def test_the_loop_answers_questions_until_stopped(self):
        stop = threading.Event()
        asked = iter([0, 5, 0, 6])

        def wait(ms):
            self.assertEqual(ms, kiwi.HINT_POLL_MS)
            q = next(asked, None)
            if q is None:
                stop.set()
                return 0
            return q

        with FakeTorch(FakeCuda()):
            kiwi._hint_loop(stop, (wait, self.done.append, self.discard))
        self.assertEqual(self.done, [5, 6])
        self.assertEqual(kiwi.hint_stats()["questions"], 2)

    def test_the_loop_survives_a_failing_wait(self):
        stop = threading.Event()
        n = []

        def wait(ms):
            n.append(ms)
            if len(n) == 1:
                raise OSError("boom")
            stop.set()
            return 0

        kiwi._hint_loop(stop, (wait, self.done.append, self.discard))
        self.assertEqual(len(n), 2)
        self.assertEqual(kiwi.hint_stats()["errors"], 1)


class WithoutTheShim(unittest.TestCase):
    def test_enable_says_so_once_and_starts_nothing(self):
        self.assertFalse(kiwi.available())
        out = io.StringIO()
        self.assertIs(kiwi.enable(stream=out), False)
        self.assertIs(kiwi.enable(stream=out), False)
        lines = out.getvalue().splitlines()
        self.assertEqual(len(lines), 1, lines)
        self.assertIn("libkiwi.so is not loaded in this process", lines[0])
        self.assertIn("kiwi.enable() does nothing", lines[0])
        self.assertFalse([t for t in threading.enumerate() if t.name == "kiwi-hint"])
        self.assertIs(kiwi.disable(), False)


if __name__ == "__main__":
    unittest.main(verbosity=2)
