"""nccl-tests / rccl-tests output parser on every saved output in ../shared/data/nccl.

Each expected value below was read off the file itself (see its `# source:` note)."""

from __future__ import annotations

import gzip

import pytest
from conftest import real_data_dir

from diag.analyzers.nccl.nccl_tests import SCHEMA, parse_file, parse_text, strip_prefix
from diag.errors import DiagInputError

TEST_PREFIXES = ("nccltests_", "rccltests_")
LOG_PREFIXES = ("nccllog_", "rccllog_", "torchlog_", "torchfr_", "inspector_")

# file -> list of expected tests: (collective, world_size, n_rows, avg_busbw, status)
EXPECTED = {
    "nccltests_NVIDIA-nccl-tests_107.txt": [("all_reduce", 1, 0, None, "partial")],
    "nccltests_NVIDIA-nccl-tests_119.txt": [("all_reduce", 24, 6, 84.8558, "ok")],
    "nccltests_NVIDIA-nccl-tests_128.txt": [("reduce_scatter", 8, 7, None, "partial")],
    "nccltests_NVIDIA-nccl-tests_15.txt": [(None, None, 0, None, "failed")],
    "nccltests_NVIDIA-nccl-tests_167.txt": [("all_reduce", None, 11, None, "partial")],
    "nccltests_NVIDIA-nccl-tests_176.txt": [("all_reduce", None, 6, None, "partial")],
    "nccltests_NVIDIA-nccl-tests_213.txt": [(None, 8, 0, None, "partial")],
    "nccltests_NVIDIA-nccl-tests_249.txt": [(None, 1, 0, None, "partial")],
    "nccltests_NVIDIA-nccl-tests_27.txt": [(None, None, 0, 3.94145, "partial")],
    "nccltests_NVIDIA-nccl-tests_287.txt": [("alltoall", 1, 1, 0.0, "ok")],
    "nccltests_NVIDIA-nccl-tests_322.txt": [(None, None, 0, None, "failed")],
    "nccltests_NVIDIA-nccl-tests_82.txt": [("broadcast", 2, 1, None, "partial")],
    "nccltests_NVIDIA-nccl-tests_pr318.txt": [("alltoall", 8, 2, None, "partial")],
    "nccltests_NVIDIA-nccl_1161.txt": [("all_reduce", 2, 3, None, "partial")],
    "nccltests_NVIDIA-nccl_1453.txt": [("all_reduce", 24, 10, None, "partial")],
    "nccltests_NVIDIA-nccl_1812.txt": [("all_reduce", 4, 0, None, "partial")],
    "nccltests_NVIDIA-nccl_340.txt": [(None, 2, 12, 6.6972, "ok"), ("broadcast", 2, 0, None, "partial")],
    "nccltests_NVIDIA-nccl_527.txt": [("all_reduce", None, 12, None, "partial")],
    "rccltests_ROCm-rccl_pr2075.txt": [("broadcast", None, 10, 3.41227, "ok")],
    "rccltests_ROCm-rccl_pr2078.txt": [("all_reduce", 16, 4, 142.652, "ok")],
}


def _names(prefixes):
    d = real_data_dir()
    if d is None or not (d / "nccl").is_dir():
        return []
    return sorted(f.name for f in (d / "nccl").iterdir() if f.name.startswith(prefixes))


def test_every_file_is_classified(real_nccl):
    names = sorted(f.name for f in real_nccl.iterdir())
    unclassified = [n for n in names if not n.startswith(TEST_PREFIXES + LOG_PREFIXES)]
    assert unclassified == []
    assert sorted(EXPECTED) == [n for n in names if n.startswith(TEST_PREFIXES)]


@pytest.mark.parametrize("name", _names(TEST_PREFIXES) or sorted(EXPECTED))
def test_tests_rows_status(real_nccl, name):
    doc = parse_file(real_nccl / name)
    assert doc["schema"] == SCHEMA
    got = [(t["collective"], t["world_size"], len(t["rows"]), t["avg_busbw_gbps"], t["status"]) for t in doc["tests"]]
    assert got == EXPECTED[name]
    for t in doc["tests"]:
        assert set(t) >= {"collective", "world_size", "backend", "rows", "avg_busbw_gbps", "status", "errors"}
        for r in t["rows"]:
            assert set(r) >= {"size_bytes", "count", "dtype", "redop", "root", "out_of_place", "in_place"}
            assert set(r["out_of_place"]) >= {"time_us", "algbw_gbps", "busbw_gbps", "wrong"}
        if t["status"] == "failed":
            assert t["errors"], "a failed test carries its error lines"


@pytest.mark.parametrize("name", _names(LOG_PREFIXES) or ["nccllog_NVIDIA-nccl_1232.txt"])
def test_pure_logs_are_not_mistaken_for_tables(real_nccl, name):
    # NCCL logs without an nccl-tests header/table must not produce a test, and say so.
    text = (real_nccl / name).read_text()
    tests = parse_text(text, source=name)
    if "# nThread" in text:
        assert all(t["rows"] == [] for t in tests)
    else:
        assert tests == []
        with pytest.raises(DiagInputError, match=name):
            parse_file(real_nccl / name)


def _one(real_nccl, name, i=0):
    return parse_file(real_nccl / name)["tests"][i]


def test_new_layout_rows_and_footer(real_nccl):
    t = _one(real_nccl, "nccltests_NVIDIA-nccl-tests_119.txt")
    first, last = t["rows"][0], t["rows"][-1]
    assert first["size_bytes"] == 127926280 and first["count"] == 31981570
    assert (first["dtype"], first["redop"], first["root"]) == ("float", "sum", -1)
    assert first["out_of_place"] == {"time_us": 2560.7, "algbw_gbps": 49.96, "busbw_gbps": 95.75, "wrong": 0}
    assert last["in_place"]["busbw_gbps"] == 95.94
    assert t["out_of_bounds"] == 0
    assert t["max_busbw_gbps"] == 96.69
    assert t["inferred"] == ["collective", "world_size"]


def test_zero_size_rows_and_per_rank_counts(real_nccl):
    t = _one(real_nccl, "nccltests_NVIDIA-nccl-tests_128.txt")
    assert [r["size_bytes"] for r in t["rows"]] == [0, 0, 0, 0, 0, 128, 256]
    assert t["rows"][5]["count"] == 4 and t["rows"][5]["out_of_place"]["time_us"] == 32.31
    # count 4 floats of 128 bytes: per-rank counts on 8 ranks, with a reduction -> reduce_scatter
    assert (t["collective"], t["world_size"]) == ("reduce_scatter", 8)


def test_rows_cycle_through_redops(real_nccl):
    t = _one(real_nccl, "nccltests_NVIDIA-nccl-tests_167.txt")
    assert [r["redop"] for r in t["rows"]] == ["max"] * 6 + ["min"] * 5
    assert t["rows"][5]["size_bytes"] == 204800 and t["rows"][6]["size_bytes"] == 196608
    assert t["rows"][-1]["in_place"]["busbw_gbps"] == 3.0


def test_old_error_column_is_a_delta_not_a_count(real_nccl):
    t = _one(real_nccl, "nccltests_NVIDIA-nccl-tests_176.txt")
    oop = t["rows"][0]["out_of_place"]
    assert oop["wrong"] is None and oop["error"] == 1e-06
    assert t["rows"][0]["root"] is None and t["rows"][0]["redop"] == "sum"
    assert t["rows"][-1]["out_of_place"]["busbw_gbps"] == 2.15
    t = _one(real_nccl, "nccltests_NVIDIA-nccl_527.txt")
    assert [r["out_of_place"]["error"] for r in t["rows"][:5]] == [2e-07, 2e-07, 2e-07, 2e-07, 5e-07]
    assert t["rows"][-1]["in_place"]["busbw_gbps"] == 0.54


def test_oldest_layout_without_redop_and_two_tests(real_nccl):
    doc = parse_file(real_nccl / "nccltests_NVIDIA-nccl_340.txt")
    first, second = doc["tests"]
    assert first["rows"][0] == {
        "size_bytes": 65536, "count": 8192, "dtype": "float", "redop": None, "root": None,
        "out_of_place": {"time_us": 16.57, "algbw_gbps": 1.98, "busbw_gbps": 1.98, "wrong": None, "error": 0.0},
        "in_place": {"time_us": 13.83, "algbw_gbps": 2.37, "busbw_gbps": 2.37, "wrong": None, "error": 0.0},
    }
    # 8192 floats of 65536 bytes: per-rank count on 2 ranks; without a redop column the
    # collective (all_gather or reduce_scatter) stays unknown instead of being guessed
    assert first["collective"] is None and first["inferred"] == ["world_size"]
    assert second["binary"] == "broadcast"
    assert second["params"] == {"nthread": 1, "ngpus": 2, "min_bytes": 8, "max_bytes": 134217728,
                                "step_factor": 2, "warmup_iters": 5, "iters": 20}


def test_broadcast_old_layout_with_root_and_interleaved_warnings(real_nccl):
    t = _one(real_nccl, "nccltests_NVIDIA-nccl-tests_82.txt")
    row = t["rows"][0]
    assert (row["size_bytes"], row["root"], row["redop"]) == (8, 0, None)
    assert row["out_of_place"]["time_us"] == 45.82 and row["out_of_place"]["error"] is None
    assert t["nccl_version"] == "2.9.6+cuda11.2"
    assert t["hosts"] == ["v100-gpu-1", "v100-gpu-5"]
    assert len(t["warnings"]) == 2 and all("Failed to open libibverbs" in w for w in t["warnings"])
    assert t["errors"] == []


def test_na_cells_overflowing_values_and_single_rank(real_nccl):
    t = _one(real_nccl, "nccltests_NVIDIA-nccl-tests_287.txt")
    row = t["rows"][0]
    assert row["redop"] == "none" and row["out_of_place"]["algbw_gbps"] == 1715.44
    assert row["in_place"] == {"time_us": 0.78, "algbw_gbps": 43046.1, "busbw_gbps": 0.0, "wrong": None}
    assert t["devices"][0]["name"] == "NVIDIA GeForce RTX 5090" and t["devices"][0]["pid"] == 2181762


def test_mid_line_launcher_tags_are_stripped(real_nccl):
    t = _one(real_nccl, "nccltests_NVIDIA-nccl_1453.txt")
    sizes = [r["size_bytes"] for r in t["rows"]]
    assert sizes[0] == 1048576 and sizes[-1] == 536870912 and len(sizes) == 10
    row = t["rows"][sizes.index(67108864)]
    assert row["out_of_place"]["busbw_gbps"] == 5.27 and row["in_place"]["time_us"] == 24425


def test_row_cut_mid_line_is_partial(real_nccl):
    t = _one(real_nccl, "nccltests_NVIDIA-nccl_1161.txt")
    assert t["rows"][1]["out_of_place"]["time_us"] == 18535
    assert t["rows"][-1]["in_place"] is None and t["rows"][-1]["truncated"] is True
    assert t["status"] == "partial" and t["params"] == {}


def test_failures_carry_their_error_lines(real_nccl):
    t = _one(real_nccl, "nccltests_NVIDIA-nccl-tests_15.txt")
    assert "NCCL failure common.cu:921 'unhandled system error'" in t["errors"]
    assert any("include/socket.h:385 NCCL WARN Net : Connection closed by remote peer" in e for e in t["errors"])
    t = _one(real_nccl, "nccltests_NVIDIA-nccl-tests_322.txt")
    assert "HCA-14: Test NCCL failure common.cu:1204 'unhandled cuda error (run with NCCL_DEBUG=INFO for details) / '" in t["errors"]
    assert any(e.startswith("mpirun detected that one or more processes exited") for e in t["errors"])


def test_non_mpi_build_duplicated_output_is_explained(real_nccl):
    for name in ("nccltests_NVIDIA-nccl-tests_107.txt", "nccltests_NVIDIA-nccl-tests_213.txt",
                 "nccltests_NVIDIA-nccl-tests_27.txt"):
        t = _one(real_nccl, name)
        assert any("independent test" in w and "MPI=1" in w for w in t["warnings"]), name
    t = _one(real_nccl, "nccltests_NVIDIA-nccl-tests_27.txt")
    assert t["avg_busbw_gbps_per_process"] == [3.94145, 3.94156]
    t = _one(real_nccl, "nccltests_NVIDIA-nccl-tests_213.txt")
    assert t["hosts"] == ["hw14"] and t["devices"][1]["bus_id"] == 0x34 and t["devices"][1]["group"] == 0


def test_lost_hash_marks(real_nccl):
    t = _one(real_nccl, "nccltests_NVIDIA-nccl-tests_249.txt")
    assert t["params"] == {"nthread": 1, "ngpus": 1, "min_bytes": 8, "max_bytes": 16777216, "step_factor": 2,
                           "warmup_iters": 5, "iters": 5, "agg_iters": 1, "check": 1, "graph": 0}
    assert t["devices"][0]["host"] == "nccl-846b9d30a6bb6b529fb3c170f4809fea-1725464730-worker-0"


def test_truncated_json_output(real_nccl):
    t = _one(real_nccl, "nccltests_NVIDIA-nccl-tests_pr318.txt")
    assert [r["size_bytes"] for r in t["rows"]] == [33554432, 67108864]
    assert t["rows"][0]["out_of_place"]["busbw_gbps"] == 19.648366
    assert t["rows"][0]["in_place"]["error"] is None
    assert t["nccl_version"] == "2.26.6+cudaCUDA_MAJOR.CUDA_MINOR"


def test_rccl_tests_footer_and_concluded_line(real_nccl):
    t = _one(real_nccl, "rccltests_ROCm-rccl_pr2075.txt")
    assert t["backend"] == "rccl" and t["binary"] == "broadcast"
    assert {r["root"] for r in t["rows"]} == {0} and t["rows"][-1]["out_of_place"]["time_us"] == 18781
    t = _one(real_nccl, "rccltests_ROCm-rccl_pr2078.txt")
    assert t["rows"][-1]["size_bytes"] == 17179869184 and t["rows"][-1]["in_place"]["busbw_gbps"] == 361.17


def test_rank_lines_and_pci_ids(real_nccl):
    t = _one(real_nccl, "nccltests_NVIDIA-nccl_1812.txt")
    assert [d["pci_id"] for d in t["devices"]] == ["0000:01:00", "0000:02:00", "0000:81:00", "0000:82:00"]
    assert [d["bus_id"] for d in t["devices"]] == [0x01, 0x02, 0x81, 0x82]
    assert t["nccl_version"] == "2.19.3+cuda12.2" and t["binary"] == "all_reduce"


# -- behaviour on constructed variants of the real outputs ----------------------------------

def _table_lines(real_nccl):
    text = (real_nccl / "nccltests_NVIDIA-nccl-tests_287.txt").read_text().splitlines()
    start = next(i for i, ln in enumerate(text) if ln.startswith("# nThread"))
    return text[start:]


@pytest.mark.parametrize("prefix", ["[1,0]<stdout>:", "0: ", "[0] ", "2024-05-01T10:00:00.123Z ",
                                    "[2026-08-23 09:56:58] ", "> "])
def test_launcher_prefixes_are_stripped(real_nccl, prefix):
    lines = _table_lines(real_nccl)
    text = "\n".join(prefix + ln for ln in lines)
    tests = parse_text(text)
    assert len(tests) == 1
    assert tests[0]["rows"][0]["out_of_place"]["algbw_gbps"] == 1715.44
    assert tests[0]["avg_busbw_gbps"] == 0.0 and tests[0]["status"] == "ok"
    assert strip_prefix(prefix + "# Avg bus bandwidth : 1") == "# Avg bus bandwidth : 1"


def test_wrong_values_and_oob_failed_make_the_test_fail(real_nccl):
    text = "\n".join(_table_lines(real_nccl))
    bad = text.replace("0.00      0     0.78", "0.00     12     0.78").replace(": 0 OK", ": 12 FAILED")
    t = parse_text(bad)[0]
    assert t["status"] == "failed" and t["rows"][0]["out_of_place"]["wrong"] == 12
    assert any("FAILED" in e for e in t["errors"]) and any("#wrong" in e for e in t["errors"])


def test_segfault_after_rows_fails_and_cut_run_is_partial(real_nccl):
    lines = _table_lines(real_nccl)
    body = [ln for ln in lines if "Avg bus" not in ln and "Out of bounds" not in ln]
    crashed = parse_text("\n".join(body + ["[node1:12345] *** Process received signal ***",
                                           "Segmentation fault (core dumped)"]))[0]
    assert crashed["status"] == "failed" and "Segmentation fault (core dumped)" in crashed["errors"]
    cut = parse_text("\n".join(body))[0]
    assert cut["status"] == "partial" and len(cut["rows"]) == 1


def test_several_tests_in_one_file(real_nccl):
    a = (real_nccl / "rccltests_ROCm-rccl_pr2078.txt").read_text()
    b = (real_nccl / "nccltests_NVIDIA-nccl-tests_287.txt").read_text()
    tests = parse_text(a + "\n" + b)
    assert [(t["collective"], len(t["rows"]), t["status"]) for t in tests] == [
        ("all_reduce", 4, "ok"), ("alltoall", 1, "ok")]


def test_bad_input_files(tmp_path, real_nccl):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DiagInputError, match="empty.txt: empty file"):
        parse_file(empty)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(bytes(range(256)) * 40)
    with pytest.raises(DiagInputError, match="garbage.bin: binary"):
        parse_file(garbage)
    gz = tmp_path / "out.txt.gz"
    gz.write_bytes(gzip.compress((real_nccl / "rccltests_ROCm-rccl_pr2078.txt").read_bytes()))
    assert parse_file(gz)["tests"][0]["avg_busbw_gbps"] == 142.652


def test_mangled_lines_never_raise(real_nccl):
    # every line of every saved output cut in pieces, as in badly pasted logs
    for f in sorted(real_nccl.iterdir()):
        pieces = []
        for ln in f.read_text().splitlines():
            for cut in range(3, len(ln), max(1, len(ln) // 5)):
                pieces += [ln[:cut], ln[cut:]]
        for t in parse_text("\n".join(pieces), source=f.name):
            assert t["status"] in ("ok", "failed", "partial")


@pytest.mark.parametrize("damage", ["time!", "tim", "xtime", "time(us)"])
def test_a_header_whose_time_column_is_damaged_is_not_a_table(real_nccl, damage):
    """A fuzzed copy of the second header of a duplicated output raised ValueError: "time"
    in the line but no column of that name."""
    text = (real_nccl / "nccltests_NVIDIA-nccl-tests_107.txt").read_text()
    clean = parse_text(text)
    header = next(ln for ln in text.splitlines() if "size" in ln and "redop" in ln and "algbw" in ln)
    damaged = text.replace(header, header.replace(" time ", f" {damage} ") + "\n" + header, 1)
    tests = parse_text(damaged)
    assert [t["status"] for t in tests] == [t["status"] for t in clean]
    assert [len(t["rows"]) for t in tests] == [len(t["rows"]) for t in clean]


@pytest.mark.parametrize("cell", ["1" * 100_000, "9" * 400, "12345678901234567890123"], ids=["1e5 digits", "400 nines", "23 digits"])
def test_a_cell_of_digits_beyond_any_count_is_no_number(real_nccl, cell):
    """A fuzzed row whose time cell held a run of 500,000 digits raised OverflowError."""
    text = (real_nccl / "nccltests_NVIDIA-nccl-tests_167.txt").read_text()
    clean = parse_text(text)
    row = next(ln for ln in text.splitlines() if ln.strip()[:1].isdigit() and len(ln.split()) > 8)
    cells = row.split()
    damaged = text.replace(row, row.replace(f" {cells[5]} ", f" {cell} ", 1), 1)
    tests = parse_text(damaged)  # the damaged row at most is lost
    assert [len(t["rows"]) + 1 >= len(c["rows"]) for t, c in zip(tests, clean)] == [True] * len(clean)


def test_world_size_from_the_command_line(real_nccl):
    # an excerpt without "# Rank" lines: ranks = launcher processes x -g x -t of the nccl-tests command
    footer = "\n".join(ln for ln in (real_nccl / "rccltests_ROCm-rccl_pr2078.txt").read_text().splitlines()
                       if not ln.startswith("# source"))
    t = parse_text("mpirun -n 4 --host a,b ./build/all_reduce_perf -b 8 -e 1G -f 2 -g 2 -n 100\n" + footer)[0]
    assert (t["collective"], t["world_size"], t["binary"]) == ("all_reduce", 8, "all_reduce")
    t = parse_text("./build/all_reduce_perf -b 8 -e 1G -n 100\n" + footer)[0]
    assert t["world_size"] == 16 and t["inferred"] == ["world_size"]  # -n is iterations here


# Per-line prefixes real launchers and log collectors write: OpenMPI's --timestamp-output
# (alone and with --tag-output) and a collector's own "date time host | ", which no fixed
# rule knows and which is found from the lines themselves.
LINE_PREFIXES = {
    "mpirun --timestamp-output": lambda i: f"Thu Jul 18 15:41:{i % 60:02d} 2024<stdout>:",
    "mpirun --timestamp-output --tag-output": lambda i: f"Thu Jul 18 15:41:{i % 60:02d} 2024[1,{i % 4}]<stdout>:",
    "log collector": lambda i: f"2024/07/18 15:41:{i % 60:02d} node-{i % 3:02d} | ",
}


def _table(text):
    return [[(r["size_bytes"], r["count"], r["dtype"], r["out_of_place"], r["in_place"]) for r in t["rows"]]
            for t in parse_text(text)]


@pytest.mark.parametrize("prefix", sorted(LINE_PREFIXES))
def test_a_prefix_on_every_line_changes_no_row(real_nccl, prefix):
    files = sorted(real_nccl.glob("nccltests_*.txt"))
    assert len(files) >= 15
    for path in files:
        text = path.read_text(errors="replace")
        plain = _table(text)
        prefixed = "\n".join(LINE_PREFIXES[prefix](i) + line for i, line in enumerate(text.splitlines()))
        assert _table(prefixed) == plain, path.name
    assert sum(map(len, plain)) > 0


def test_the_shared_prefix_is_not_found_where_there_is_none(real_nccl):
    from diag.analyzers.nccl.nccl_tests import shared_prefix

    for path in sorted(real_nccl.glob("nccltests_*.txt")):
        lines = [strip_prefix(x) for x in path.read_text(errors="replace").splitlines()]
        assert shared_prefix(lines) is None, path.name


# nccl-tests prints each row's head as "%12li  %12li  %8s  %6s  %6i" (size, count, type, the
# reduction's name, root); an operation without a reduction passed an empty name in older
# versions (alltoall), so its cell is six spaces under a header that has the redop column.
BLANK_REDOP = """# nThread 1 nGpus 8 minBytes 1048576 maxBytes 4194304 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
     1048576         32768     float             -1    55.31   18.96   16.59      0    54.87   19.11   16.72    N/A
     2097152         65536     float             -1    80.12   26.17   22.90      0    79.55   26.36   23.07    N/A
     4194304        131072     float             -1    131.4   31.92   27.93      0    130.9   32.04   28.04    N/A
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 22.54
#
"""


def test_a_blank_reduction_cell_leaves_the_other_cells_in_place():
    t = parse_text(BLANK_REDOP)[0]
    assert t["status"] == "ok"
    first = t["rows"][0]
    assert (first["dtype"], first["redop"], first["root"]) == ("float", None, -1)
    assert first["out_of_place"] == {"time_us": 55.31, "algbw_gbps": 18.96, "busbw_gbps": 16.59, "wrong": 0}
    assert t["rows"][-1]["in_place"]["busbw_gbps"] == 28.04
    assert t["max_busbw_gbps"] == 28.04
