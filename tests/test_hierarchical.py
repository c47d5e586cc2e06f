"""Several hosts: the hierarchical collectives on real ranks of emulated hosts, what the
cost model predicts for them, topology-aware auto, and the placement planner."""
import os

import numpy as np
import pytest

import ringlet as rl
from ringlet.algorithms import CATALOG
from ringlet.algorithms.all_reduce import hierarchical_pieces
from ringlet.cost import TIERS, Topology, breakdown, choose, simulate
from ringlet.cost.tune import build_schedule
from conftest import run, two_hosts

HIERARCHICAL = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


# -- real ranks on two emulated hosts ----------------------------------------------------
def _check_all(rank, algorithm, group_ranks):
    g = rl.new_group(group_ranks) if group_ranks else None
    me = group_ranks.index(rank) if group_ranks else rank
    if group_ranks and rank not in group_ranks:
        return
    p = len(group_ranks) if group_ranks else rl.get_world_size()
    for count in (0, 1, 7, 4099, 70_001):
        rng = [np.random.default_rng(1000 * r + count) for r in range(p)]
        x = [gen.integers(-50, 50, (p, count)).astype(np.int64) for gen in rng]
        # all_gather
        out = np.empty((p, count), np.int64)
        rl.all_gather(out, x[me][0], group=g, algorithm=algorithm)
        assert np.array_equal(out, np.stack([x[r][0] for r in range(p)])), ("all_gather", count)
        # reduce_scatter
        mine = np.empty(count, np.int64)
        rl.reduce_scatter(mine, x[me].copy(), group=g, algorithm=algorithm)
        assert np.array_equal(mine, sum(x[r][me] for r in range(p))), ("reduce_scatter", count)
        # broadcast from every root
        for root in range(p):
            buf = x[me][1 % p].copy() if count else np.empty(0, np.int64)
            rl.broadcast(buf, src=root, group=g,    # src: a group rank
                         algorithm=algorithm)
            assert np.array_equal(buf, x[root][1 % p]), ("broadcast", root, count)
        # all_reduce
        buf = x[me][0].copy()
        rl.all_reduce(buf, group=g, algorithm=algorithm)
        assert np.array_equal(buf, sum(x[r][0] for r in range(p))), ("all_reduce", count)


@pytest.mark.parametrize("p,split", [(4, 2), (5, 2), (6, 3)])
@pytest.mark.parametrize("algorithm", ["hierarchical", "auto"])
def test_hierarchical_collectives_on_two_hosts(p, split, algorithm):
    """Equal and unequal hosts (5 ranks: 2 + 3): NumPy's answer, forced or picked by auto."""
    run(_check_all, p, algorithm, None, env={"RINGLET_HOST_ID_SPLIT": str(split)})


def _uneven_all_gather(rank):
    p = rl.get_world_size()
    for count in (65_536, 65_537):        # blocks of 512 KiB and just over (a large message)
        out = np.empty((p, count), np.int64)
        rl.all_gather(out, np.full(count, rank + 1, np.int64), algorithm="hierarchical")
        assert (out == np.arange(1, p + 1)[:, None]).all(), count


def test_hierarchical_all_gather_on_hosts_of_two_sizes():
    """Hosts of 2, 1 and 1 ranks: a rank sends a peer a block its local copy writes and an
    empty one in one round; they go in that order, as the peer receives them (the empty one
    had gone first, and the peer took it for the block)."""
    run(_uneven_all_gather, 4, env={"RINGLET_HOST_ID_SPLIT": "2,3"})


def _pipelined(rank):
    p = rl.get_world_size()
    count = (12 << 20) // 8 + 5            # 12 MiB of int64 and a ragged end: 3 pieces
    assert hierarchical_pieces(count * 8, 2, 3) == 3
    x = np.random.default_rng(rank).integers(-50, 50, count)
    want = sum(np.random.default_rng(r).integers(-50, 50, count) for r in range(p))
    rl.all_reduce(x, algorithm="hierarchical")
    assert np.array_equal(x, want)


def test_pipelined_hierarchical_all_reduce():
    """A large buffer runs in pieces (unequal hosts: 2 + 3 ranks): NumPy's answer."""
    run(_pipelined, 5, env={"RINGLET_HOST_ID_SPLIT": "2"})


def test_hierarchical_group_with_hosts_interleaved():
    """A group whose ranks alternate between the two hosts (group rank order 0, 2, 1, 3)."""
    run(_check_all, 4, "hierarchical", [0, 2, 1, 3], env=two_hosts(4))


# -- the cost model --------------------------------------------------------------------
@pytest.mark.parametrize("collective", HIERARCHICAL)
@pytest.mark.parametrize("h,m", [(2, 2), (2, 4), (4, 8), (3, 5)])
def test_closed_form_is_the_simulated_schedule(collective, h, m):
    """The closed form in cost/model.py prices exactly the schedule the runtime runs."""
    topo = Topology(h, m, "nvlink", "ethernet")
    for nbytes in (4096 * h * m, 64 << 20):
        sched = build_schedule(collective, "hierarchical", h * m, nbytes,
                               hosts=tuple(int(x) for x in topo.host_array))
        sim = simulate(sched, topo).time
        form = breakdown(collective, nbytes, h * m, "hierarchical", "ethernet", hosts=h,
                         intra="nvlink", inter="ethernet").total
        # (a rooted call's closed form holds its agreement too: algorithms.agree_alongside)
        assert form == pytest.approx(sim, rel=1e-5)   # segments differ by an element at most
        if sched.agreement:
            assert simulate(sched.without_agreement(), topo).time <= sim


def _ring_time(p, blk, link):
    """Hand count: a flat ring over contiguous hosts waits on its slowest (inter-host)
    link at every step: (p - 1) steps of one block."""
    return (p - 1) * link.time(blk)


def _hier_time(h, m, blk, intra, inter):
    """Hand count of the hierarchical all_gather / reduce_scatter (γ = 0): (h - 1) steps
    of one block across, the m ranks of a host sharing its NIC, then (m - 1) steps of h
    blocks inside the host."""
    return (h - 1) * (inter.alpha + m * blk * inter.beta) + (m - 1) * intra.time(h * blk)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("h,m", [(2, 4), (4, 8), (8, 8), (64, 8)])
def test_simulator_predicts_the_hierarchical_factor(collective, h, m):
    """On NVLink hosts joined by Ethernet the simulator's flat-ring / hierarchical ratio is
    the hand-counted one: about (p−1)/(p−m) for large messages (one NIC per host), and
    far more for small ones, where (p−1)α₂ becomes (h−1)α₂."""
    p = h * m
    topo = Topology(h, m, "nvlink", "ethernet")
    intra, inter = TIERS["nvlink"], TIERS["ethernet"]
    for nbytes in (1 << 16, 256 << 20):
        nbytes = nbytes // p * p
        blk = nbytes / p
        hosts = tuple(int(x) for x in topo.host_array)
        times = {alg: simulate(build_schedule(collective, alg, p, nbytes, hosts=hosts), topo).time
                 for alg in ("ring", "hierarchical")}
        want = _ring_time(p, blk, inter) / _hier_time(h, m, blk, intra, inter)
        assert times["ring"] / times["hierarchical"] == pytest.approx(want, rel=0.02)
        assert times["ring"] > times["hierarchical"]


def test_simulator_all_reduce_factor_two_hosts():
    """all_reduce, 2 hosts x 4 ranks, 256 MiB: flat ring moves 2(p−1)/p·n over the host
    boundary, hierarchical 2(h−1)/h·n through a host's NIC: about 7/4."""
    topo = Topology(2, 4, "nvlink", "ethernet")
    hosts = (0, 0, 0, 0, 1, 1, 1, 1)
    t = {alg: simulate(build_schedule("all_reduce", alg, 8, 256 << 20, hosts=hosts), topo).time
         for alg in ("ring", "hierarchical")}
    assert t["ring"] / t["hierarchical"] == pytest.approx(7 / 4, rel=0.03)


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter"])
def test_auto_picks_hierarchical_across_hosts(collective):
    """With several hosts auto considers the hierarchical variants and picks them where
    the model says they win; on one host they are not candidates."""
    topo = Topology(4, 8, "nvlink", "ethernet")
    winner, rows = choose(collective, 64 << 20, 32, topology=topo)
    assert winner == "hierarchical" and rows[0].method == "simulated"
    assert {r.algorithm for r in rows} == set(CATALOG[collective])
    winner, rows = choose(collective, 64 << 20, 32, topology="ethernet")
    assert "hierarchical" not in {r.algorithm for r in rows}


def test_auto_keeps_flat_when_hosts_are_one_rank_each():
    """One rank per host: hierarchical is the flat ring plus staging, never better."""
    topo = Topology(8, 1, "nvlink", "ethernet")
    for coll in ("all_gather", "reduce_scatter"):
        rows = dict((r.algorithm, r.total) for r in choose(coll, 64 << 20, 8, topology=topo)[1])
        assert rows["hierarchical"] >= rows["ring"] * 0.999


def test_simulator_splits_the_critical_path_by_link():
    """SimResult.inter: the part of the critical path on inter-host messages. A flat ring
    over 2 hosts waits on the host boundary at every step; the hierarchical all_gather
    spends some of its path inside the hosts; one host has no inter-host part."""
    topo = Topology(2, 4, "nvlink", "ethernet")
    hosts = tuple(int(x) for x in topo.host_array)
    ring = simulate(build_schedule("all_gather", "ring", 8, 8 << 20, hosts=hosts), topo)
    assert ring.inter == pytest.approx(ring.time)
    hier = simulate(build_schedule("all_gather", "hierarchical", 8, 8 << 20, hosts=hosts), topo)
    lat, bw, _ = hier.terms
    assert 0 < hier.inter < lat + bw
    one = simulate(build_schedule("all_gather", "ring", 8, 8 << 20), Topology(1, 8, "nvlink"))
    assert one.inter == 0


def test_explain_shows_intra_and_inter_host_terms(capsys):
    from ringlet.commands import explain_main
    assert explain_main(["all_gather", "-n", "16", "--hosts", "2", "--tier", "ethernet",
                         "--size", "64M", "--range", "1M:64M"]) == 0
    out = capsys.readouterr().out
    assert "intra NVLink" in out and "inter Ethernet" in out
    assert "intra-host" in out and "inter-host" in out
    row = next(line for line in out.splitlines() if line.startswith("hierarchical"))
    total, lat, bw, red, intra, inter = map(float, row.split()[1:7])
    assert intra + inter == pytest.approx(lat + bw, abs=0.02) and inter > intra > 0
    assert "winner: hierarchical" in out


# -- placement ---------------------------------------------------------------------------
from itertools import combinations  # noqa: E402

from ringlet.cost.place import Comm, expert_parallel, place, price, tensor_data_parallel  # noqa: E402

M = 1 << 20


def _inside_hosts(groups, hosts):
    return all(len({hosts[r] for r in g}) == 1 for g in groups)


def test_place_keeps_tensor_parallel_inside_hosts_when_it_dominates():
    """TP traffic dominates: TP groups inside hosts — the naive (Megatron) order — wins."""
    comms = tensor_data_parallel(4, 4, tp_bytes=256 * M, dp_bytes=4 * M)
    pl = place(comms, 4, 4)
    assert _inside_hosts(comms[0].groups, pl.hosts)
    assert pl.time == pytest.approx(pl.naive_time) and pl.hosts == pl.naive_hosts
    # the other way round is predicted worse
    dp_inside = [r % 4 for r in range(16)]
    assert price(comms, 4, 4, dp_inside)[0] > 2 * pl.time


def test_place_moves_data_parallel_inside_hosts_when_it_dominates():
    """DP traffic dominates: the planner puts each DP group on one host and predicts it
    faster than the naive order by far."""
    comms = tensor_data_parallel(4, 4, tp_bytes=4 * M, dp_bytes=256 * M)
    pl = place(comms, 4, 4)
    assert _inside_hosts(comms[1].groups, pl.hosts)
    assert not _inside_hosts(comms[0].groups, pl.hosts)
    assert pl.naive_time > 10 * pl.time
    total, per = price(comms, 4, 4, pl.hosts)
    assert total == pytest.approx(pl.time) and per == pytest.approx(pl.per_comm)
    assert "dp" in str(pl) and "naive" in str(pl)


def test_place_finds_the_best_mapping_of_a_small_job():
    """2 hosts x 3 ranks, an expert-parallel job whose groups interleave: brute force over
    every mapping agrees with the planner (the swap search reaches the optimum)."""
    comms = [Comm("ep", ((0, 2, 4), (1, 3, 5)), "all_to_all", 64 * M, 2),
             Comm("pp", ((0, 1),), "all_reduce", 1 * M)]
    pl = place(comms, 2, 3)
    best = min(price(comms, 2, 3, [0 if r in h0 else 1 for r in range(6)])[0]
               for h0 in combinations(range(6), 3))
    assert pl.time == pytest.approx(best)
    assert _inside_hosts(comms[0].groups, pl.hosts) and pl.time < pl.naive_time


def test_place_rejects_bad_jobs():
    with pytest.raises(ValueError, match="outside the job's 4 ranks"):
        place([Comm("tp", ((0, 5),), "all_reduce", M)], 2, 2)
    with pytest.raises(ValueError, match="disjoint"):
        Comm("tp", ((0, 1), (1, 2)), "all_reduce", M)
    with pytest.raises(ValueError, match="must divide"):
        expert_parallel(6, 4, M)
    with pytest.raises(ValueError, match="ranks per host"):
        price(tensor_data_parallel(2, 2, M, M), 2, 2, [0, 0, 0, 1])


def test_place_refuses_no_hosts_naming_them(capsys):
    """--hosts 0 was reported as "dp=0"."""
    from ringlet.cli import main
    assert main(["place", "--hosts", "0", "--ranks-per-host", "2", "--tp", "2"]) == 2
    assert "--hosts and --ranks-per-host must be >= 1, got 0 and 2" in capsys.readouterr().err


def test_place_command_with_what_if(capsys):
    from ringlet.commands import place_main
    assert place_main(["--hosts", "2", "--ranks-per-host", "4", "--tp", "4", "--tp-bytes", "4M",
                       "--dp-bytes", "256M", "--inter", "infiniband", "--what-if", "16x8"]) == 0
    out = capsys.readouterr().out
    assert out.count("naive (ms)") == 2 and "16 hosts x 8 ranks" in out
    assert "found by dp groups contiguous" in out
    assert place_main(["--hosts", "2", "--ranks-per-host", "2", "--tp", "3",
                       "--tp-bytes", "1M"]) == 2


# -- the inter-host link ----------------------------------------------------------------
def test_a_link_rate_prices_the_link_between_hosts():
    from ringlet.cost.profile import TCP_GOODPUT, default_profile, parse_rate
    base = default_profile()
    prof = base.with_link_rate("1gbit")
    assert parse_rate("10gbit") == 1.25e9 and parse_rate("500mbit") == 62.5e6
    with pytest.raises(ValueError, match="1gbit"):
        parse_rate("fast")
    assert prof.link("inter").bandwidth == pytest.approx(1e9 / 8 * TCP_GOODPUT)
    for link in (prof.link("tcp"), base.link("inter")):
        assert (link.alpha, link.bandwidth) == (base.link("tcp").alpha, base.link("tcp").bandwidth)
    # a flat ring's boundary carries 2(p-1)/p of the buffer each way: at the link's rate
    n = 16 << 20
    rows = {r.algorithm: r.total for r in choose("all_reduce", n, 4, topology=prof, hosts=2)[1]}
    assert rows["ring"] == pytest.approx(1.5 * n / prof.link("inter").bandwidth, rel=0.05)
    fast = {r.algorithm: r.total for r in choose("all_reduce", n, 4, topology=base, hosts=2)[1]}
    assert rows["ring"] > 5 * fast["ring"]


def test_hosts_on_one_machine_share_its_cores(tmp_path, monkeypatch, capsys):
    # emulated hosts: each round of a schedule must also fit in the machine's CPU - its
    # bytes between hosts at the measured CPU per byte, spread over the cores
    from ringlet.cost.host import Machine
    from ringlet.cost.model import Link
    from ringlet.cost.profile import default_profile
    n = 16 << 20
    sched = build_schedule("all_reduce", "ring", 4, n, hosts=(0, 0, 1, 1))
    links = (Link(0.0, 1e12), Link(0.0, 1e10))
    alone = simulate(sched, Topology(2, 2, *links)).time
    crossing = simulate(sched, Topology(2, 2, *links)).bytes["inter"]
    # (poll=0: the bytes' CPU alone; test_cost prices the crowded ranks' polling)
    slow = simulate(sched, Topology(2, 2, *links, machine=Machine(1, 1e-9, poll=0.0))).time
    assert slow == pytest.approx(crossing * 1e-9) and slow > 1.5 * alone   # CPU-bound
    many = simulate(sched, Topology(2, 2, *links, machine=Machine(10 ** 6, 1e-9))).time
    assert many == pytest.approx(alone)
    with pytest.raises(ValueError, match="cores"):
        Machine(0, 1e-9)
    # other processes' load leaves the job part of the cores: the CPU-bound rounds stretch
    half = simulate(sched, Topology(2, 2, *links,
                                    machine=Machine(2, 1e-9, available=0.5, poll=0.0))).time
    assert half == pytest.approx(2 * slow)
    assert Machine(2, 1e-9).capacity == 2 and Machine(2, 1e-9, available=0.5).capacity == 0.5
    for bad in (-0.5, 3.0):
        with pytest.raises(ValueError, match="available"):
            Machine(2, 1e-9, available=bad)
    # the profile carries it from the link's calibration to auto
    base = default_profile()
    assert base.with_link_rate("10gbit").machine() is None
    prof = base.with_link_rate("10gbit", machine=(1, 2e-9))
    assert (prof.machine().cores, prof.machine().inter) == (1, 2e-9)
    assert prof.machine().capacity == 1
    loaded = base.with_link_rate("10gbit", machine=(2, 2e-9, 0.7)).machine()
    assert (loaded.cores, loaded.available) == (2, 0.7)
    priced = {name: {r.algorithm: r.total for r in choose("all_reduce", n, 4, topology=p,
                                                          hosts=2)[1]}
              for name, p in (("link", base.with_link_rate("10gbit")), ("machine", prof))}
    assert priced["machine"]["ring"] >= 1.5 * n * 2e-9 > priced["link"]["ring"]
    # and explain prices as auto does
    from ringlet import commands
    prof.save(tmp_path / "profile.json")
    monkeypatch.setenv("RINGLET_PROFILE", str(tmp_path / "profile.json"))
    assert commands.explain_main(["all_reduce", "-n", "4", "--size", "16M", "--hosts", "2"]) == 0
    assert "one machine of 1 cores" in capsys.readouterr().out


def test_inter_host_messages_pay_the_rendezvous_only_above_tcps_eager_limit():
    # TCP sends a message of up to its eager limit at once and a larger one after an
    # RTS/CTS round trip: between hosts only the larger ones pay alpha_rdv
    from conftest import HOST_PROFILE
    from ringlet.cost.profile import Profile
    from ringlet.transport import limits
    tcp = {**HOST_PROFILE, "alpha_rdv": 4e-4, **limits.facts(False)["tcp"]}
    prof = Profile.from_fits({"shm": dict(HOST_PROFILE), "tcp": tcp}).with_link_rate("1gbit")
    inter = prof.link("inter")
    eager = limits.TCP_EAGER_BYTES
    assert inter.eager == eager and inter.alpha - inter.alpha_eager == pytest.approx(4e-4)
    topo = Topology(2, 1, prof.link("shm"), inter)

    def one(nbytes):
        return simulate(build_schedule("broadcast", "direct", 2, nbytes), topo).time
    wire = 4 * inter.beta
    # (the schedule agrees as the data moves: the data one way, an empty message the other)
    assert one(eager) == pytest.approx(inter.alpha_eager + eager * inter.beta)
    assert one(eager + 4) - one(eager) == pytest.approx(4e-4 + wire)
    # and auto sees it: a small all_reduce across hosts costs no round trip per message
    small = {r.algorithm: r for r in choose("all_reduce", 1024, 4, topology=prof, hosts=2)[1]}
    assert small["ring"].total < inter.alpha           # less than one round trip


def test_ringlet_run_link_rate_reaches_auto(tmp_path):
    import subprocess
    import sys
    script = tmp_path / "job.py"
    script.write_text("import ringlet as rl\nfrom ringlet.runtime import job_profile\nrl.init()\n"
                      "print('inter', job_profile().link('inter').bandwidth)\nrl.destroy()\n")
    proc = subprocess.run([sys.executable, "-m", "ringlet.cli", "run", "-n", "2", "--link-rate",
                           "1gbit", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = [float(line.split()[-1]) for line in proc.stdout.splitlines() if " inter " in line]
    assert len(got) == 2 and all(b < 1.25e8 for b in got), proc.stdout
    bad = subprocess.run([sys.executable, "-m", "ringlet.cli", "run", "-n", "2", "--link-rate",
                          "fast", str(script)], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "1gbit" in bad.stderr


def test_calibrate_link_rate_is_saved_and_reaches_auto(tmp_path):
    """`ringlet calibrate --link-rate` saves the inter-host link in the profile: every rank
    of a job reads it (rank 0's), and auto prices multi-host groups with it."""
    import subprocess
    import sys
    from ringlet.cost.profile import TCP_GOODPUT, load_profile
    path = tmp_path / "profile.json"
    env = dict(os.environ, RINGLET_PROFILE=str(path))
    proc = subprocess.run([sys.executable, "-m", "ringlet.cli", "calibrate", "--transports", "",
                           "--link-rate", "1gbit", "--output", str(path)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert load_profile(path).link("inter").bandwidth == pytest.approx(1e9 / 8 * TCP_GOODPUT)
    script = tmp_path / "job.py"
    script.write_text("import ringlet as rl\nfrom ringlet.runtime import job_profile\nrl.init()\n"
                      "print('inter', job_profile().link('inter').bandwidth)\nrl.destroy()\n")
    run = subprocess.run([sys.executable, "-m", "ringlet.cli", "run", "-n", "2", str(script)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0, run.stderr
    got = [float(line.split()[-1]) for line in run.stdout.splitlines() if " inter " in line]
    assert got == [pytest.approx(1e9 / 8 * TCP_GOODPUT)] * 2, run.stdout
    for bad in (["--transports", "", "--link-rate", "fast"], ["--transports", ""]):
        proc = subprocess.run([sys.executable, "-m", "ringlet.cli", "calibrate", *bad,
                               "--output", str(path)], capture_output=True, text=True,
                              timeout=60, env=env)
        assert proc.returncode == 2 and "error" in proc.stderr, proc.stderr
