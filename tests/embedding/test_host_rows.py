"""HostRows against a plain numpy table: random gathers and scatters (duplicates across
calls), growth across the RAM -> disk boundary, bfloat16 weights, per-row and per-dim
slots, a full disk, page release and cleanup."""

import errno
import os

import ml_dtypes
import numpy as np
import pytest

from sparsejax.embedding.host._host_rows import HostRows, HostStorageFullError
from sparsejax.ops.optimizers import Adagrad, RowWiseAdagrad

BF16 = np.dtype(ml_dtypes.bfloat16)
SLOTS = [("acc", True, 0.5), ("m", False, 0.0), ("v", False, -1.0)]


class Reference:
    """The whole table as plain numpy arrays."""

    def __init__(self, dim, dtype, slots):
        self.dim, self.dtype, self.slots = dim, np.dtype(dtype), slots
        self.w = np.zeros((0, dim), self.dtype)
        self.s = {n: np.zeros((0,) if r else (0, dim), np.float32) for n, r, _ in slots}

    def ensure(self, rows):
        extra = rows - len(self.w)
        if extra > 0:
            self.w = np.concatenate([self.w, np.zeros((extra, self.dim), self.dtype)])
            for n, r, init in self.slots:
                fresh = np.full((extra,) if r else (extra, self.dim), init, np.float32)
                self.s[n] = np.concatenate([self.s[n], fresh])


def check_same(rows: HostRows, ref: Reference, idx):
    w, s = rows.gather(idx)
    assert w.dtype == ref.dtype and w.shape == (len(idx), ref.dim)
    np.testing.assert_array_equal(w, ref.w[idx])
    assert set(s) == set(ref.s)
    for n in s:
        assert s[n].dtype == np.float32
        np.testing.assert_array_equal(s[n], ref.s[n][idx])


@pytest.mark.parametrize(
    "dtype,ram_bytes,block_rows",
    [
        ("float32", None, 64),  # RAM only
        ("float32", 3000, 32),  # RAM, then disk
        ("bfloat16", 6000, 48),  # bf16, a block size that is not a power of two
        ("bfloat16", 0, 64),  # disk only
    ],
)
def test_random_against_reference(tmp_path, dtype, ram_bytes, block_rows):
    rng = np.random.default_rng(0)
    dim = 5
    rows = HostRows(
        "user id", dim, dtype, SLOTS, ram_bytes=ram_bytes, disk_dir=str(tmp_path),
        block_rows=block_rows,
    )  # fmt: skip
    ref = Reference(dim, rows.dtype, SLOTS)
    size = 0
    for step in range(12):
        size += int(rng.integers(10, 60))  # grows across blocks and tiers
        rows.ensure(size)
        ref.ensure(rows.capacity)
        assert rows.capacity >= size and rows.capacity % block_rows == 0
        check_same(rows, ref, rng.integers(0, rows.capacity, 200))  # duplicates too
        idx = rng.choice(size, min(size, 70), replace=False)
        w = rng.standard_normal((idx.size, dim)).astype(np.float32)
        slots = {
            "acc": rng.random(idx.size, dtype=np.float32),
            "m": rng.standard_normal((idx.size, dim), dtype=np.float32),
            "v": rng.random((idx.size, dim), dtype=np.float32),
        }
        if step % 3 == 1:  # part of the row: weights only, or one slot only
            rows.scatter(idx, w)
            ref.w[idx] = w.astype(ref.dtype)
            rows.scatter(idx[:5], None, {"m": slots["m"][:5]})
            ref.s["m"][idx[:5]] = slots["m"][:5]
        else:
            rows.scatter(idx.astype(np.int32), w, slots)
            ref.w[idx] = w.astype(ref.dtype)  # f32 -> bf16 rounds as numpy casts
            for n, v in slots.items():
                ref.s[n][idx] = v
        reset = rng.choice(size, 9, replace=False)
        rows.reset_slots(reset)
        for n, _, init in SLOTS:
            ref.s[n][reset] = init
        probe = rng.integers(0, rows.capacity, 300)
        check_same(rows, ref, probe)
        want = np.linalg.norm(ref.w[probe].astype(np.float32), axis=1)
        np.testing.assert_allclose(rows.norms(probe), want, rtol=1e-6)
        if step % 4 == 3:
            rows.release_pages()  # data stays, read back from the files
    check_same(rows, ref, np.arange(rows.capacity))
    blocks = rows.num_blocks
    if ram_bytes is None:
        assert rows.disk_bytes_used == 0 and rows.ram_bytes_used == blocks * rows.block_bytes
    else:
        ram_blocks = ram_bytes // rows.block_bytes
        assert rows.ram_bytes_used == ram_blocks * rows.block_bytes <= ram_bytes
        assert rows.disk_bytes_used >= (blocks - ram_blocks) * rows.block_bytes > 0
        assert len(os.listdir(next(tmp_path.iterdir()))) == blocks - ram_blocks
    rows.close()
    assert list(tmp_path.iterdir()) == []  # files and the table's directory deleted
    rows.close()  # idempotent


def test_optimizer_slot_specs_and_row_ids():
    """Slots straight from SparseOptimizer.slots(); a table whose row i holds i."""
    for opt in (RowWiseAdagrad(learning_rate=0.1), Adagrad(learning_rate=0.1)):
        with HostRows("t", 3, "float32", opt.slots(), block_rows=16) as rows:
            rows.ensure(40)
            ids = np.arange(40)
            rows.scatter(ids, np.repeat(ids[:, None], 3, 1).astype(np.float32))
            w, s = rows.gather(ids[::-1])
            np.testing.assert_array_equal(w[:, 0], ids[::-1])
            (spec,) = opt.slots()
            assert s[spec.name].shape == ((40,) if spec.per_row else (40, 3))
            np.testing.assert_array_equal(s[spec.name], np.float32(spec.init))


def test_empty_and_bad_rows():
    with HostRows("clicks", 2, "float32", [("acc", True, 0.0)], block_rows=8) as rows:
        rows.ensure(5)
        assert rows.capacity == 8
        w, s = rows.gather(np.zeros(0, np.int64))
        assert w.shape == (0, 2) and s["acc"].shape == (0,)
        rows.scatter(np.zeros(0, np.int64), np.zeros((0, 2)), {"acc": np.zeros(0)})
        with pytest.raises(IndexError, match="'clicks'.*row 8 is outside"):
            rows.gather(np.array([1, 8]))
        with pytest.raises(IndexError, match="row -1"):
            rows.norms(np.array([-1]))
        with pytest.raises(ValueError, match=r"weights must have shape \[1, 2\]"):
            rows.scatter(np.array([1]), np.zeros((1, 3)))
        with pytest.raises(KeyError, match="unknown slot"):
            rows.scatter(np.array([1]), None, {"nope": np.zeros(1)})
    with pytest.raises(ValueError, match="needs a disk_dir"):
        HostRows("t", 2, "float32", ram_bytes=10)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        HostRows("t", 2, "float16")


def test_full_disk_is_one_line_error_and_keeps_rows(tmp_path, monkeypatch):
    rows = HostRows("ad id", 4, "bfloat16", SLOTS, ram_bytes=0, disk_dir=str(tmp_path),
                    block_rows=16)  # fmt: skip
    rows.ensure(32)
    w = np.arange(32 * 4, dtype=np.float32).reshape(32, 4)
    rows.scatter(np.arange(32), w)

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(HostStorageFullError) as info:
        rows.ensure(40)
    msg = str(info.value)
    assert "\n" not in msg and isinstance(info.value, OSError)
    assert info.value.errno == errno.ENOSPC
    assert "'ad id'" in msg and str(tmp_path) in msg
    assert "need 4.00 KiB (4096 bytes)" in msg and "bytes) free" in msg
    assert rows.capacity == 32  # nothing half-made
    assert len(os.listdir(next(tmp_path.iterdir()))) == 2  # the failed block's file is gone
    np.testing.assert_array_equal(rows.gather(np.arange(32))[0], w.astype(rows.dtype))

    # the free-space check before any allocation: more than the disk holds
    monkeypatch.undo()
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(HostStorageFullError, match=r"bytes\) free"):
        rows.ensure(32 + (free // rows.row_bytes) * 2)
    assert rows.capacity == 32
    rows.ensure(48)  # room again: grows
    np.testing.assert_array_equal(rows.gather(np.arange(32))[0], w.astype(rows.dtype))
    rows.close()


def test_release_pages_drops_resident_pages(tmp_path):
    """The disk tier leaves RSS after release_pages (mincore-free check: /proc smaps)."""
    rows = HostRows("t", 64, "float32", (), ram_bytes=0, disk_dir=str(tmp_path), block_rows=4096)
    rows.ensure(4 * 4096)  # 4 MiB on disk
    rows.scatter(np.arange(rows.capacity), np.ones((rows.capacity, 64), np.float32))

    def mapped_rss_kib():
        total, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                if not line[0].isupper():  # a mapping's header line
                    inside = str(tmp_path) in line
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1])
        return total

    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("no /proc/self/smaps")
    assert mapped_rss_kib() >= 4000
    rows.release_pages()
    assert mapped_rss_kib() < 100
    np.testing.assert_array_equal(rows.norms(np.array([0, rows.capacity - 1])), 8.0)
    rows.close()
