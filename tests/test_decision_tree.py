"""The decision tree file and its evaluator: every branch, overrides, config files, advisories."""

import pytest

from diag.analyzers.diagnosis import decision_tree as dt


def shares(data=0.0, host=0.0, comm=0.0, memory=0.0, compute=0.0, **extra):
    return {"data_share": data, "host_share": host, "comm_share": comm,
            "memory_share": memory, "compute_share": compute, **extra}


@pytest.fixture(scope="module")
def tree():
    return dt.load_tree()


@pytest.mark.parametrize(
    "m, bound, nodes",
    [
        (shares(data=0.25, compute=0.75), "data", ["data_wait"]),
        (shares(data=0.15, host=0.45, compute=0.4), "host", ["data_wait", "peer_wait", "device_busy", "idle_cause"]),
        (shares(comm=0.3, compute=0.5, memory=0.2, memory_to_compute=0.4), "comm",
         ["data_wait", "peer_wait", "device_busy", "exposed_comm"]),
        (shares(comm=0.1, compute=0.3, memory=0.6, memory_to_compute=2.0), "memory",
         ["data_wait", "peer_wait", "device_busy", "exposed_comm", "memory_vs_compute"]),
        (shares(compute=0.7, memory=0.3, memory_to_compute=0.4, achieved_bw_frac=0.85), "memory",
         ["data_wait", "peer_wait", "device_busy", "exposed_comm", "memory_vs_compute", "bandwidth_of_peak"]),
        (shares(compute=0.7, memory=0.3, memory_to_compute=0.4, achieved_bw_frac=0.5), "compute",
         ["data_wait", "peer_wait", "device_busy", "exposed_comm", "memory_vs_compute", "bandwidth_of_peak"]),
    ],
)
def test_each_branch(tree, m, bound, nodes):
    verdict = dt.evaluate(m, tree)
    assert verdict["bound"] == bound
    assert [p["node"] for p in verdict["path"]] == nodes
    assert verdict["fixes"], "every verdict carries fixes"


def test_idle_mostly_data_branch_needs_a_raised_data_threshold(tree):
    # With the default 20% data threshold this branch cannot be reached when the shares sum
    # to 1 (data < 20% and data > host leave the device busy > 60%); raising it opens it.
    m = shares(data=0.35, host=0.25, compute=0.4)
    assert dt.evaluate(m, tree)["bound"] == "data"
    raised = dt.load_tree(overrides={"data_wait": 0.5})
    verdict = dt.evaluate(m, raised)
    assert verdict["bound"] == "data"
    assert [p["node"] for p in verdict["path"]] == ["data_wait", "peer_wait", "device_busy", "idle_cause"]


def test_path_records_value_threshold_and_answer(tree):
    verdict = dt.evaluate(shares(data=0.3, compute=0.7), tree)
    first = verdict["path"][0]
    assert first["value"] == pytest.approx(0.3)
    assert first["threshold"] == pytest.approx(0.20)
    assert first["answer"] == "yes"
    assert "20%" in first["question"]


def test_boundary_is_inclusive_where_the_file_says_so(tree):
    # data_wait uses >=: exactly 20% is data-bound; exposed_comm uses >: exactly 20% is not comm-bound.
    assert dt.evaluate(shares(data=0.20, compute=0.8), tree)["bound"] == "data"
    m = shares(comm=0.20, compute=0.8, memory_to_compute=0.1)
    assert dt.evaluate(m, tree)["bound"] == "compute"


def test_unmeasured_metric_answers_unknown(tree):
    verdict = dt.evaluate(shares(compute=0.9, memory=0.1), tree)
    answers = {p["node"]: p["answer"] for p in verdict["path"]}
    assert answers["memory_vs_compute"] == "unknown"
    assert answers["bandwidth_of_peak"] == "unknown"
    assert verdict["bound"] == "compute"


def test_cli_override_changes_the_verdict():
    m = shares(data=0.25, compute=0.75)
    assert dt.evaluate(m, dt.load_tree())["bound"] == "data"
    raised = dt.load_tree(overrides=dt.parse_overrides(["data_wait=0.3"]))
    assert raised.thresholds["data_wait"] == 0.3
    assert dt.evaluate(m, raised)["bound"] == "compute"


@pytest.mark.parametrize("suffix, text", [
    (".toml", "[thresholds]\nexposed_comm = 0.1\n"),
    (".yaml", "thresholds:\n  exposed_comm: 0.1\n"),
])
def test_config_file_overrides(tmp_path, suffix, text):
    cfg = tmp_path / f"diag{suffix}"
    cfg.write_text(text)
    m = shares(comm=0.15, compute=0.85, memory_to_compute=0.1)
    assert dt.evaluate(m, dt.load_tree())["bound"] == "compute"
    assert dt.evaluate(m, dt.load_tree(cfg))["bound"] == "comm"


@pytest.mark.parametrize("bad", ["nonsense", "data_wait", "data_wait=abc"])
def test_bad_override_is_a_clear_error(bad):
    with pytest.raises(dt.TreeError):
        dt.load_tree(overrides=dt.parse_overrides([bad]))


def test_unknown_threshold_name_is_rejected():
    with pytest.raises(dt.TreeError, match="unknown threshold 'data_wiat'"):
        dt.load_tree(overrides={"data_wiat": 0.1})


def test_bad_config_file(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[thresholds\n")
    with pytest.raises(dt.TreeError, match="bad.toml"):
        dt.load_tree(cfg)
    with pytest.raises(dt.TreeError, match="not found"):
        dt.load_tree(tmp_path / "missing.toml")


def test_advisories_fire_on_their_thresholds(tree):
    ids = {f["id"] for f in dt.advise(shares(compute=1.0, mfu=0.3, memory_used_frac=0.5), tree)}
    assert ids == {"low_mfu", "low_memory_use"}
    assert dt.advise(shares(compute=1.0, mfu=0.6, memory_used_frac=0.9), tree) == []


def test_advisory_that_repeats_the_verdict_is_dropped(tree):
    m = shares(comm=0.3, compute=0.7)
    assert [f["id"] for f in dt.advise(m, tree)] == ["comm_share_notable"]
    assert dt.advise(m, tree, bound="comm") == []
    assert [f["id"] for f in dt.advise(m, tree, bound="compute")] == ["comm_share_notable"]


def test_waiting_for_a_peer_is_not_comm(tree):
    """A step that waits 30% for another rank is handed to that rank; its transfer (5%) is not comm-bound."""
    m = shares(comm=0.05, compute=0.55, memory=0.1, memory_to_compute=0.2, wait_share=0.30)
    v = dt.evaluate(m, tree)
    assert v["bound"] == dt.PEER
    assert [p["node"] for p in v["path"]] == ["data_wait", "peer_wait"]
    # Waiting occupies the device as its transfer does: the device counts as busy.
    assert dt.derive(m)["busy_share"] == pytest.approx(0.05 + 0.30 + 0.1 + 0.55)
    # Below the threshold the rank's own work decides, and comm is the transfer alone.
    m["wait_share"] = 0.10
    assert dt.evaluate(m, tree)["bound"] == "compute"


def test_forced_answer_is_recorded(tree):
    m = shares(comm=0.05, compute=0.55, memory=0.1, memory_to_compute=0.2, wait_share=0.30)
    v = dt.evaluate(m, tree, force={"peer_wait": ("no", "ranks wait for each other in turn")})
    assert v["bound"] == "compute"
    node = next(p for p in v["path"] if p["node"] == "peer_wait")
    assert node["answer"] == "no" and node["forced"] == "ranks wait for each other in turn"
    assert node["value"] == 0.30  # the measurement is still shown


def test_one_step_and_many_steps_take_the_same_walk(tree):
    """evaluate (one step, the agent's loop) and Walker.walk (a run's steps at once) are the
    same evaluator: on random measurements, some missing, they give the same path and verdict."""
    import numpy as np

    from diag.analyzers.diagnosis.decision_tree import Walker, derive, evaluate

    rng = np.random.default_rng(7)
    metrics = ["data_share", "wait_share", "busy_share", "data_fraction_of_idle", "comm_share",
               "memory_to_compute", "achieved_bw_frac"]
    n = 500
    cols = {k: rng.uniform(0, 1.5 if k == "memory_to_compute" else 1, n) for k in metrics}
    for k in metrics:
        cols[k][rng.uniform(size=n) < 0.2] = np.nan  # unmeasured in some steps
    walker = Walker(tree)
    sig, verdict = walker.walk(cols, n)
    for i in range(n):
        m = {k: float(cols[k][i]) for k in metrics if not np.isnan(cols[k][i])}
        assert derive(m) == m  # nothing derived: both walks see the same numbers
        one = evaluate(m, tree)
        assert one["bound"] == verdict[i]
        assert [(p["node"], p["answer"]) for p in one["path"]] == list(walker.sigs[int(sig[i])])
    forced = {"data_wait": ("no", "test")}
    sig_f, verdict_f = walker.walk(cols, n, forced)
    assert all(walker.sigs[int(s)][0] == ("data_wait", "no") for s in sig_f.tolist())


def test_the_tree_asks_only_about_registered_measurements():
    """Every node and advisory names a measurement of the registry, whose unit every view prints by."""
    from diag.analyzers.diagnosis import decision_tree as dt

    tree = dt.load_tree()
    assert {n["metric"] for n in tree.nodes.values()} | {a["metric"] for a in tree.advisories} <= set(dt.MEASUREMENTS)
    with pytest.raises(dt.TreeError, match="not a registered measurement"):
        dt._check_metrics({"nodes": {"odd": {"metric": "vibes_share"}}, "advisories": []})
    assert dt.metric_text("memory_to_compute", 0.19) == "0.19x" and dt.metric_text("data_share", 0.2, True) == "20%"
    assert dt.metric_text("data_share", 0.1234) == "12.3%" and dt.metric_text("mfu", None) == "unknown"
