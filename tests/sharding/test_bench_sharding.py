"""experiments/bench_sharding.py: its HLO collective parser counts what it documents, and a
tiny run on the 2x4 mesh gives the planner's bytes (plus the loss's scalar all-reduce) at
two vocabulary sizes, the same at both, with the send buffers of before (`--exchange
full`); right-sized buffers move fewer bytes, within 1.25x of what must move. No timing
is checked."""

import importlib.util
import pathlib

import pytest

PATH = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "bench_sharding.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_sharding", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HLO = """HloModule jit_step, entry_computation_layout={...}

%region_0.1 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  ROOT %add = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main.2 (p0: s32[8,16], p1: f32[4,2]) -> f32[32,2] {
  %all-to-all = (s32[8,16]{1,0}, s32[8,16]{1,0}) all-to-all(s32[8,16]{1,0} %p0, s32[8,16] %p0)
  %all-gather = f32[32,2]{1,0} all-gather(f32[4,2]{1,0} %p1), replica_groups=[1,8]<=[8]
  %reduce-scatter = f32[1,2]{1,0} reduce-scatter(f32[4,2]{1,0} %p1), to_apply=%region_0.1
  %all-reduce-start = f32[2]{0} all-reduce-start(f32[2]{0} %x), to_apply=%region_0.1
  %all-reduce-done = f32[2]{0} all-reduce-done(f32[2]{0} %all-reduce-start)
  ROOT %cp = bf16[4,2]{1,0} collective-permute(bf16[4,2]{1,0} %y), source_target_pairs={{0,1}}
}
"""


def test_hlo_parser_counts_each_collective_once_by_its_full_buffer(bench):
    got = {c["op"]: c["bytes"] for c in bench.hlo_collectives(HLO)}
    assert got == {
        "all-to-all": 2 * 8 * 16 * 4,  # both operands of the tuple
        "all-gather": 32 * 2 * 4,  # the result
        "reduce-scatter": 4 * 2 * 4,  # the operand
        "all-reduce": 2 * 4,  # counted at its start only
        "collective-permute": 4 * 2 * 2,
    }
    assert all(c["computation"].startswith("ENTRY") for c in bench.hlo_collectives(HLO))


def test_quick_run_matches_the_planner_and_does_not_depend_on_the_vocabulary(bench):
    args = bench.parse_args(
        [
            "--quick",
            "--in-process",
            "--placements",
            "row_wise",
            "table_wise",
            "--no-baseline",
            "--no-time",
            "--exchange",
            "full",
        ]
    )
    rows = bench.measure(args, log=lambda s: None)
    assert [(r["placement"], r["vocab"]) for r in rows] == [
        ("row_wise", 100),
        ("table_wise", 100),
        ("row_wise", 10_000),
        ("table_wise", 10_000),
    ]
    for r in rows:  # the one extra: the loss's all-reduce of one f32 per feature
        assert r["hlo"] - r["formula"] == 4 * args.tables, r
    assert bench.check(rows) == 0


def test_right_sized_buffers_move_fewer_bytes_within_a_quarter_of_the_need(bench):
    flags = ["--quick", "--in-process", "--placements", "row_wise", "table_wise"]
    flags += ["--no-baseline", "--no-time", "--vocabs", "1000"]
    full = bench.measure(bench.parse_args([*flags, "--exchange", "full"]), log=lambda s: None)
    sized = bench.measure(bench.parse_args(flags), log=lambda s: None)
    for f, s in zip(full, sized, strict=True):
        assert s["hlo"] < f["hlo"], (f, s)
        e = s["exchange"]
        assert e["needed"] <= e["sent"] <= 1.25 * e["needed"], s
        assert e["sent_ids"] < f["exchange"]["sent_ids"], (f, s)
        assert all(c < n for c, n in s["capacity"].values()), s
