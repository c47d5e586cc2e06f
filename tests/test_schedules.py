"""Every (collective, algorithm) schedule, executed in one process by ringlet.reference,
against a plain NumPy reference; plus traffic against the textbook counts.

Zero-size messages are kept (count 0, count < p, empty all-to-all blocks), so an
algorithm's messages depend only on (p, root, hosts, segments) and the message counts
below hold for every count; byte counts are exact when p divides count.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringlet.algorithms import CATALOG, ROOTED, build, pipeline_segments, tree_segments
from ringlet.algorithms import all_reduce as ar
from ringlet.algorithms import reduce as rd
from ringlet.algorithms._common import lg, subtree
from ringlet.reference import run
from ringlet.schedule import Schedule, chunks

@pytest.fixture(autouse=True)
def no_leftover_shm():
    """Overrides conftest's /dev/shm check: these tests start no processes, and ranks of
    other jobs running on the host at the same time must not fail them."""
    yield


CASES = [(c, a) for c, table in CATALOG.items() for a in table]
REDUCING = {"all_reduce", "reduce", "reduce_scatter"}
INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
FLOATS = [np.float16, np.float32, np.float64]
ARITH = [np.add, np.multiply, np.minimum, np.maximum]
BITWISE = [np.bitwise_and, np.bitwise_or, np.bitwise_xor]
EXAMPLES = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
COUNTS = st.one_of(st.sampled_from([0, 1, 2, 3, 5, 7, 11, 13, 31, 97, 1009]),
                   st.integers(0, 40), st.integers(0, 3000))


# -- inputs and the NumPy reference ------------------------------------------------------
def values(rng, n, dtype, op):
    """Random data on which every evaluation order gives the same answer: full-range
    integers; small integers / powers of two for float sums / products."""
    dtype = np.dtype(dtype)
    if dtype == bool:
        return rng.random(n) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    if op is np.add:
        return rng.integers(-4, 5, n).astype(dtype)
    if op is np.multiply:
        return rng.choice(np.array([-2, -1, -0.5, 0, 0.5, 1, 2], dtype), n)
    return rng.standard_normal(n).astype(dtype)


def garbage(rng, n, dtype):
    """What "tmp" and "out" hold before the collective: a schedule must not read it."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return np.full(n, np.nan, dtype)
    return values(rng, n, dtype, None)


def block_sizes(p, count, splits):
    return np.full((p, p), count) if splits is None else np.array(splits, np.int64).reshape(p, p)


def make_bufs(s: Schedule, dtype, op, rng):
    """Per-rank buffers for schedule ``s`` (only those the runtime binds on that rank)."""
    p, n, root, tmp = s.p, s.count, s.root, s.buffers["tmp"]
    coll = s.collective
    bufs = [{"tmp": garbage(rng, tmp, dtype)} for _ in range(p)]
    for r, b in enumerate(bufs):
        if coll in ("all_reduce", "broadcast", "reduce"):
            b["buf"] = values(rng, n, dtype, op)
        elif coll == "all_gather":
            b["in"], b["out"] = values(rng, n, dtype, op), garbage(rng, p * n, dtype)
        elif coll == "reduce_scatter":
            b["in"], b["out"] = values(rng, p * n, dtype, op), garbage(rng, n, dtype)
        elif coll in ("all_to_all", "all_to_all_single"):
            sizes = block_sizes(p, n, s.splits)
            b["in"], b["out"] = values(rng, sizes[r].sum(), dtype, op), garbage(rng, sizes[:, r].sum(), dtype)
        elif coll == "gather":
            b["in"] = values(rng, n, dtype, op)
            if r == root:
                b["out"] = garbage(rng, p * n, dtype)
        elif coll == "scatter":
            b["out"] = garbage(rng, n, dtype)
            if r == root:
                b["in"] = values(rng, p * n, dtype, op)
    return bufs


def expected(s: Schedule, before, op):
    """What each rank must hold afterwards: {rank: {buffer: array}} (unchanged inputs too)."""
    p, n, root, coll = s.p, s.count, s.root, s.collective
    want = [{} for _ in range(p)]
    if coll in ("all_reduce", "reduce"):
        x = [b["buf"] for b in before]
        total = op.reduce(np.stack(x), axis=0, dtype=x[0].dtype)
        for r in range(p):
            want[r]["buf"] = total if coll == "all_reduce" or r == root else x[r]
    elif coll == "broadcast":
        for r in range(p):
            want[r]["buf"] = before[root]["buf"]
    elif coll == "all_gather":
        for r in range(p):
            want[r]["out"] = np.concatenate([b["in"] for b in before])
    elif coll == "reduce_scatter":
        x = [b["in"] for b in before]
        total = op.reduce(np.stack(x), axis=0, dtype=x[0].dtype)
        for r in range(p):
            want[r]["out"] = total[r * n:(r + 1) * n]
    elif coll in ("all_to_all", "all_to_all_single"):
        sizes = block_sizes(p, n, s.splits)
        edges = np.concatenate([np.zeros((p, 1), np.int64), np.cumsum(sizes, axis=1)], axis=1)
        for j in range(p):
            want[j]["out"] = np.concatenate(
                [before[i]["in"][edges[i, j]:edges[i, j + 1]] for i in range(p)])
    elif coll == "gather":
        want[root]["out"] = np.concatenate([b["in"] for b in before])
    elif coll == "scatter":
        for r in range(p):
            want[r]["out"] = before[root]["in"][r * n:(r + 1) * n]
    for r in range(p):   # inputs the collective promises not to touch
        for name in ("in",):
            if name in before[r]:
                want[r].setdefault(name, before[r][name])
    return want


def execute(s: Schedule, dtype, op, seed):
    rng = np.random.default_rng(seed)
    bufs = make_bufs(s, dtype, op, rng)
    before = [{k: v.copy() for k, v in b.items()} for b in bufs]
    run(s, bufs, op)
    return bufs, expected(s, before, op)


def assert_results(s, bufs, want):
    for r, w in enumerate(want):
        for name, arr in w.items():
            got = bufs[r][name]
            assert got.shape == arr.shape and np.array_equal(got, arr), (
                f"{s.collective}/{s.algorithm} p={s.p} count={s.count} root={s.root}: "
                f"rank {r} {name} = {got[:12]}…, expected {arr[:12]}…")


# -- correctness: every (collective, algorithm) -------------------------------------------
@st.composite
def problems(draw, collective, algorithm):
    p = draw(st.integers(1, 8))
    count = draw(COUNTS)
    kind = draw(st.sampled_from(["int", "float", "bool"]))
    dtype = draw(st.sampled_from({"int": INTS, "float": FLOATS, "bool": [np.bool_]}[kind]))
    ops = {"int": ARITH + BITWISE, "float": ARITH, "bool": BITWISE + [np.minimum, np.maximum]}[kind]
    op = draw(st.sampled_from(ops)) if collective in REDUCING else np.add
    root = draw(st.integers(0, p - 1)) if collective in ROOTED else 0
    hosts = None
    if algorithm == "hierarchical":
        hosts = draw(st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=p, max_size=p)))
    splits = None
    if collective.startswith("all_to_all"):
        matrix = st.lists(st.lists(st.integers(0, 30), min_size=p, max_size=p), min_size=p, max_size=p)
        splits = draw(matrix if collective == "all_to_all_single" else st.one_of(st.none(), matrix))
    return p, count, dtype, op, root, hosts, splits, draw(st.integers(0, 2**32 - 1))


@pytest.mark.parametrize("collective,algorithm", CASES)
@EXAMPLES
@given(data=st.data())
def test_results_match_numpy(collective, algorithm, data):
    p, count, dtype, op, root, hosts, splits, seed = data.draw(problems(collective, algorithm))
    s = build(collective, algorithm, p, count, itemsize=np.dtype(dtype).itemsize, root=root,
              hosts=hosts, splits=splits)
    s.validate()
    assert s.collective == collective and s.algorithm == algorithm and s.p == p
    bufs, want = execute(s, dtype, op, seed)
    assert_results(s, bufs, want)


@pytest.mark.parametrize("collective,algorithm", CASES)
@pytest.mark.parametrize("p", [9, 12, 13, 16])
def test_larger_groups(collective, algorithm, p):
    for count, root in ((0, 0), (p - 1, p // 3), (5 * p + 3, p - 1)):
        s = build(collective, algorithm, p, count, root=root if collective in ROOTED else 0,
                  hosts=tuple(r % 3 for r in range(p)) if algorithm == "hierarchical" else None,
                  splits=block_sizes(p, 2, None).tolist() if collective == "all_to_all_single" else None)
        s.validate()
        bufs, want = execute(s, np.int64, np.add, count)
        assert_results(s, bufs, want)


@pytest.mark.parametrize("algorithm", list(CATALOG["all_reduce"]))
@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), count=st.integers(0, 300), dtype=st.sampled_from(FLOATS),
       op=st.sampled_from(ARITH), zeros=st.booleans(), seed=st.integers(0, 2**32 - 1),
       hosts=st.lists(st.integers(0, 2), min_size=8, max_size=8))
def test_all_reduce_bit_identical_floats(algorithm, p, count, dtype, op, zeros, seed, hosts):
    """Real-valued floats (and signed zeros): every rank ends with the same bits."""
    rng = np.random.default_rng(seed)
    x = [rng.standard_normal(count).astype(dtype) for _ in range(p)]
    if zeros:   # ±0 ties: np.minimum/np.maximum are not bitwise commutative on them
        x = [np.where(rng.random(count) < 0.5, np.copysign(0, a), a).astype(dtype) for a in x]
    s = build("all_reduce", algorithm, p, count, itemsize=np.dtype(dtype).itemsize,
              hosts=hosts[:p] if algorithm == "hierarchical" else None)
    bufs = run(s, [{"buf": a.copy()} for a in x], op)
    first = bufs[0]["buf"].tobytes()
    assert all(b["buf"].tobytes() == first for b in bufs), f"{algorithm} p={p}: ranks differ"
    ref = functools.reduce(op, [a.astype(np.float64) for a in x]) if p else None
    eps = np.finfo(dtype).eps
    if op is np.add:
        tol = 2 * p * eps * np.sum(np.abs(np.stack(x).astype(np.float64)), axis=0) + 1e-300
        assert np.all(np.abs(bufs[0]["buf"].astype(np.float64) - ref) <= tol)
    elif op is np.multiply:
        assert np.allclose(bufs[0]["buf"].astype(np.float64), ref, rtol=4 * p * eps,
                           atol=p * float(np.finfo(dtype).tiny))
    else:
        assert np.array_equal(bufs[0]["buf"].astype(np.float64), ref)


def _gloo_case(p, count, seed):
    """p float32 vectors whose sums depend on how their additions are grouped."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(count) * np.exp(4 * rng.standard_normal(count))).astype(np.float32)
            for _ in range(p)]


def _in_gloos_order(x, blocks):
    """Block b of ``blocks`` (offsets, sizes) summed as x_b + (x_{b+1} + (… + x_{b−1})),
    ranks mod p: Gloo's ring toward lower ranks."""
    off, size = blocks
    p, count = len(x), len(x[0])
    assert size.sum() == count and (size[:-1] >= size[1:]).all()
    want = np.empty(count, np.float32)
    for b in range(p):
        part = slice(off[b], off[b] + size[b])
        acc = x[(b - 1) % p][part]
        for k in range(2, p + 1):
            acc = x[(b - k) % p][part] + acc
        want[part] = acc
    return want


@settings(max_examples=60, deadline=None)
@given(p=st.integers(2, 8), count=st.one_of(st.integers(0, 300), st.integers(262_000, 800_000)),
       seed=st.integers(0, 2**32 - 1))
def test_gloo_ring_groups_each_sum_as_gloo(p, count, seed):
    """Block b (``gloo_blocks``: segments of ceil(count / S), S/p of them per rank) sums
    in Gloo's ring order, on every rank."""
    x = _gloo_case(p, count, seed)
    bufs = run(build("all_reduce", "gloo_ring", p, count), [{"buf": a.copy()} for a in x], np.add)
    want = _in_gloos_order(x, ar.gloo_blocks(p, count, 4))
    assert all(r["buf"].tobytes() == want.tobytes() for r in bufs)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(2, 8), count=st.one_of(st.integers(0, 300), st.integers(1_500_000, 2_500_000)),
       root=st.integers(0, 7), seed=st.integers(0, 2**32 - 1))
def test_gloo_ring_reduce_groups_each_sum_as_gloo(p, count, root, seed):
    """reduce's gloo_ring: block b (``gloo_reduce_blocks``) sums at the root in Gloo's ring
    order; every other rank's buf is unchanged."""
    root %= p
    x = _gloo_case(p, count, seed)
    bufs = run(build("reduce", "gloo_ring", p, count, root=root), [{"buf": a.copy()} for a in x],
               np.add)
    want = _in_gloos_order(x, rd.gloo_reduce_blocks(p, count, 4))
    assert bufs[root]["buf"].tobytes() == want.tobytes()
    assert all(bufs[r]["buf"].tobytes() == x[r].tobytes() for r in range(p) if r != root)


def test_gloo_reduce_blocks():
    """Segments of ceil(count / 2p) elements, at most 1 MiB, cut before their number: from
    2p MiB on the blocks part from the all-reduce's."""
    assert [s.tolist() for s in rd.gloo_reduce_blocks(4, 10)] == [[0, 4, 8, 10], [4, 4, 2, 0]]
    assert rd.gloo_reduce_blocks(3, 2_100_001)[1].tolist() == [786432, 786432, 527137]
    assert ar.gloo_blocks(3, 2_100_001)[1].tolist() == [700002, 700002, 699997]


def test_gloo_blocks():
    """Whole segments of ceil(count / S) per rank, S >= 2p a multiple of p, segments <= 1 MiB."""
    assert [s.tolist() for s in ar.gloo_blocks(4, 10)] == [[0, 4, 8, 10], [4, 4, 2, 0]]
    assert ar.gloo_blocks(4, 100)[1].tolist() == [26, 26, 26, 22]
    off, size = ar.gloo_blocks(2, 6_250_000, 4)        # 25 MB: 24 segments of 1 MiB or less
    assert size.tolist() == [12 * 260_417, 6_250_000 - 12 * 260_417]
    assert ar.gloo_blocks(3, 0)[1].tolist() == [0, 0, 0]


def test_seed_000_code_4_2_2():
    """Output 4.2.2: four ranks, 2(K−1) = 6 messages, every rank holds [20 16 17]."""
    local = [np.array(v) for v in ([8, 6, 5], [3, 3, 1], [1, 1, 2], [8, 6, 9])]
    s = build("all_reduce", "naive_ring", 4, 3, itemsize=8)
    assert s.messages == 6
    bufs = run(s, [{"buf": a.copy()} for a in local])
    for b in bufs:
        assert b["buf"].tolist() == [20, 16, 17]


# -- traffic against the textbook ----------------------------------------------------------
PS = range(1, 14)
POW2 = [1, 2, 4, 8, 16]


def traffic(collective, algorithm, p, count, itemsize=4, **kw):
    s = build(collective, algorithm, p, count, itemsize=itemsize, **kw).without_agreement()
    return s, s.traffic()


@pytest.mark.parametrize("p", PS)
def test_traffic_all_reduce_ring(p):
    """Seed 004: 2(p−1) messages and 2(p−1)/p·n bytes per rank."""
    for count in (12 * p, 12 * p + 5, 3, 0):
        n = count * 4
        s, t = traffic("all_reduce", "ring", p, count)
        assert (t["sent_messages"] == 2 * (p - 1)).all() and (t["recv_messages"] == 2 * (p - 1)).all()
        assert t["sent_bytes"].sum() == 2 * (p - 1) * n
        if count % p == 0:
            assert (t["sent_bytes"] * p == 2 * (p - 1) * n).all()
        else:
            assert (np.abs(t["sent_bytes"] - 2 * (p - 1) / p * n) <= 2 * 4).all()
        assert len(s.rounds) == 2 * (p - 1)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("collective", ["broadcast", "reduce", "gather", "scatter"])
def test_traffic_dissemination_is_the_barriers_carrying_the_tree(collective, p):
    """A rooted "dissemination" algorithm sends exactly the barrier's lg p messages per rank
    in lg p rounds (no agreement before it), and the bytes of its binomial tree: every
    non-root gets the n (or its block) once; the root sends or takes (p−1) blocks."""
    lg = (p - 1).bit_length()
    for count in (5, 0):
        n = count * 4
        for root in {0, p // 2, p - 1}:
            s, t = traffic(collective, "dissemination", p, count, root=root)
            assert len([r for r in s.rounds if (r.cols["src"] != r.cols["dst"]).any()]) == lg
            assert (t["sent_messages"] == lg).all() and (t["recv_messages"] == lg).all()
            if collective in ("broadcast", "reduce"):
                assert t["sent_bytes"].sum() == (p - 1) * n
            elif collective == "gather":
                assert t["recv_bytes"][root] == (p - 1) * n
            else:
                assert t["sent_bytes"][root] == (p - 1) * n


@pytest.mark.parametrize("p", [2, 3, 4, 7])
def test_ring_uses_seed_004_chunk_indices(p):
    """In reduce-scatter step k rank i sends chunk (i−k) mod p to rank i+1."""
    count = 10 * p + 3
    off, size = chunks(count, p)
    s = build("all_reduce", "ring", p, count)
    for k in range(p - 1):
        for t in s.rounds[k]:
            c = (t.src - k) % p
            assert (t.dst, t.soff, t.n, t.op) == ((t.src + 1) % p, off[c], size[c], "reduce")


@pytest.mark.parametrize("p", PS)
def test_traffic_all_reduce_others(p):
    count, n = 24 * p, 24 * p * 4
    s, t = traffic("all_reduce", "naive_ring", p, count)
    assert s.messages == 2 * (p - 1) and t["sent_bytes"].sum() == 2 * (p - 1) * n
    assert all(tr.n == count for rnd in s.rounds for tr in rnd)
    s, t = traffic("all_reduce", "direct", p, count)
    assert (t["sent_messages"] == p - 1).all() and (t["sent_bytes"] == (p - 1) * n).all()
    s, t = traffic("all_reduce", "tree", p, count)
    assert s.messages == 2 * (p - 1) and t["sent_messages"][0] == lg(p) == t["recv_messages"][0]
    s, t = traffic("all_reduce", "double_tree", p, count)
    segments = tree_segments(p, count, 4)
    assert s.notes.get("segments", 1) == segments
    assert t["sent_bytes"].sum() == 2 * (p - 1) * n
    assert s.messages == 4 * (p - 1) * segments
    s, t = traffic("all_reduce", "recursive_doubling", p, count)
    p2 = 1 << (p.bit_length() - 1)
    if p == p2:
        assert (t["sent_messages"] == lg(p)).all() and (t["sent_bytes"] == lg(p) * n).all()
    else:
        assert t["sent_messages"].max() == lg(p2) + 1 and t["sent_messages"].min() == 1
    s, t = traffic("all_reduce", "rabenseifner", p, count)
    if p == p2:
        assert (t["sent_messages"] == 2 * lg(p)).all()
        assert (t["sent_bytes"] * p == 2 * (p - 1) * n).all()


@pytest.mark.parametrize("h,m", [(1, 4), (2, 1), (2, 2), (2, 3), (3, 4), (4, 2)])
def test_traffic_hierarchical(h, m):
    """2(m−1) + 2(h−1) messages per rank; only 2(h−1)·n bytes cross hosts, fewer than a
    flat ring over the same hosts."""
    p, count = h * m, 12 * h * m
    hosts = tuple(r // m for r in range(p))
    s, t = traffic("all_reduce", "hierarchical", p, count, hosts=hosts)
    assert (t["sent_messages"] == 2 * (m - 1) + 2 * (h - 1)).all()

    def inter_bytes(sched):
        return sum(tr.n for rnd in sched.rounds for tr in rnd if hosts[tr.src] != hosts[tr.dst])
    assert inter_bytes(s) == 2 * (h - 1) * count
    if h > 1 and m > 1:
        assert inter_bytes(s) < inter_bytes(build("all_reduce", "ring", p, count))
    # degenerate hosts: one host or one rank per host behave like the ring
    for degenerate in (None, (7,) * p, tuple(range(p))):
        s, t = traffic("all_reduce", "hierarchical", p, count, hosts=degenerate)
        assert (t["sent_messages"] == 2 * (p - 1)).all()
        assert (t["sent_bytes"] * p == 2 * (p - 1) * count * 4).all()


def test_hierarchical_uneven_hosts():
    hosts = (0, 0, 0, 1, 2, 2)
    s = build("all_reduce", "hierarchical", 6, 60, hosts=hosts)
    s.validate()
    inter = [tr for rnd in s.rounds for tr in rnd if hosts[tr.src] != hosts[tr.dst]]
    assert sum(tr.n for tr in inter) == 2 * (3 - 1) * 60      # each element all-reduced once
    bufs, want = execute(s, np.int32, np.add, 0)
    assert_results(s, bufs, want)


def _inter(sched, hosts):
    """Elements sent across hosts, per sending rank."""
    out = np.zeros(sched.p, np.int64)
    for rnd in sched.rounds:
        for tr in rnd:
            if hosts[tr.src] != hosts[tr.dst]:
                out[tr.src] += tr.n
    return out


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("h,m", [(1, 4), (2, 1), (2, 2), (2, 3), (3, 4), (4, 2)])
@pytest.mark.parametrize("contiguous", [True, False])
def test_traffic_hierarchical_gather_scatter(collective, h, m, contiguous):
    """Each rank sends its own block's worth across hosts h−1 times, (h−1)·count elements
    (a flat ring's boundary rank: (p−1)·count), in h−1 messages, and (m−1) messages of
    h·count inside its host; and the result is NumPy's for hosts in any order."""
    p, count = h * m, 5
    hosts = tuple(r // m if contiguous else r % h for r in range(p))
    s, t = traffic(collective, "hierarchical", p, count, hosts=hosts)
    assert (_inter(s, hosts) == (h - 1) * count).all()
    assert (t["sent_messages"] == (h - 1) + (m - 1)).all()
    assert (t["sent_bytes"] == ((h - 1) * count + (m - 1) * h * count) * 4).all()
    flat = _inter(build(collective, "ring", p, count), hosts)
    if h > 1 and m > 1 and contiguous:
        assert flat.max() == (p - 1) * count > _inter(s, hosts).max()
    bufs, want = execute(s, np.int64, np.add, h * m)
    assert_results(s, bufs, want)


@pytest.mark.parametrize("h,m,root", [(2, 2, 0), (2, 3, 4), (3, 4, 5), (4, 1, 2), (1, 5, 3)])
def test_traffic_hierarchical_broadcast(h, m, root):
    """Every host but the root's receives the buffer exactly once across hosts; every rank
    but the root receives it exactly once."""
    p, count = h * m, 1000
    hosts = tuple(r % h for r in range(p))          # hosts interleaved: still one copy each
    s = build("broadcast", "hierarchical", p, count, root=root, hosts=hosts).without_agreement()
    into = np.zeros(h, np.int64)
    for rnd in s.rounds:
        for tr in rnd:
            if hosts[tr.src] != hosts[tr.dst]:
                into[hosts[tr.dst]] += tr.n
    assert into[hosts[root]] == 0 and (np.delete(into, hosts[root]) == count).all()
    got = s.traffic()["recv_bytes"] // 4
    assert got[root] == 0 and (np.delete(got, root) == count).all()
    bufs, want = execute(s, np.int64, np.add, p)
    assert_results(s, bufs, want)


def test_hierarchical_gather_scatter_uneven_hosts():
    """A host with fewer ranks lends proxies to the columns it lacks."""
    hosts = (0, 0, 0, 1, 2, 2)
    for coll in ("all_gather", "reduce_scatter"):
        s = build(coll, "hierarchical", 6, 7, hosts=hosts)
        s.validate()
        bufs, want = execute(s, np.int32, np.add, 0)
        assert_results(s, bufs, want)


def test_double_tree_is_complementary():
    """A rank interior in one tree is a leaf in the other (odd p: rank 0 excepted)."""
    for p in range(2, 40):
        t1, t2 = ar.dtree_parents(p)
        for t in (t1, t2):
            assert (t < 0).sum() == 1
            for r in range(p):           # every rank reaches the root
                x, hops = r, 0
                while t[x] >= 0 and hops <= p:
                    x, hops = t[x], hops + 1
                assert t[x] < 0
            assert max(np.bincount(t[t >= 0], minlength=p)) <= 2
        both = set(t1[t1 >= 0]) & set(t2[t2 >= 0])
        assert both == (set() if p % 2 == 0 else {0})


@pytest.mark.parametrize("p", PS)
def test_traffic_broadcast(p):
    """Seed 004: every non-root receives n; root sends lg p (binomial), p−1 (direct)."""
    for root in {0, p // 2, p - 1}:
        count, n = 12 * p, 48 * p
        nonroot = np.arange(p) != root
        for alg in ("direct", "binomial", "pipeline"):
            s, t = traffic("broadcast", alg, p, count, root=root)
            assert (t["recv_bytes"][nonroot] == n).all() and t["recv_bytes"][root] == 0
        s, t = traffic("broadcast", "direct", p, count, root=root)
        assert t["sent_messages"][root] == p - 1
        s, t = traffic("broadcast", "binomial", p, count, root=root)
        assert s.messages == p - 1 and t["sent_messages"][root] == lg(p) and len(s.rounds) == lg(p)
        s, t = traffic("broadcast", "pipeline", p, count, root=root)
        S = pipeline_segments(p, count, 4)
        assert s.messages == (p - 1) * S and t["sent_messages"][root] == (S if p > 1 else 0)
        assert len(s.rounds) == (p - 2 + S if p > 1 else 0)
        s, t = traffic("broadcast", "scatter_allgather", p, count, root=root)
        # the ring carries to each rank only the chunks its scatter did not: every
        # non-root rank receives n in all, the root nothing
        assert t["sent_bytes"].sum() == (p - 1) * n
        assert (t["recv_bytes"][nonroot] == n).all() and t["recv_bytes"][root] == 0


def test_pipeline_segments_rule():
    assert pipeline_segments(2, 10**6) == 1 and pipeline_segments(8, 0) == 1
    assert pipeline_segments(8, 3) <= 3
    small, big = pipeline_segments(8, 1024), pipeline_segments(8, 1 << 22)
    assert 1 <= small <= big <= 64 and big > 1
    s = build("broadcast", "pipeline", 8, 1 << 22).without_agreement()
    assert s.notes["segments"] == big and s.messages == 7 * big


@pytest.mark.parametrize("p", PS)
def test_traffic_reduce(p):
    """Seed 004: every non-root sends n (direct, binomial)."""
    count, n = 8 * p, 32 * p
    for root in {0, p - 1}:
        nonroot = np.arange(p) != root
        for alg in ("direct", "binomial"):
            s, t = traffic("reduce", alg, p, count, root=root)
            assert (t["sent_bytes"][nonroot] == n).all() and t["sent_bytes"][root] == 0
        s, t = traffic("reduce", "direct", p, count, root=root)
        assert t["recv_messages"][root] == p - 1
        s, t = traffic("reduce", "binomial", p, count, root=root)
        assert s.messages == p - 1 and t["recv_messages"][root] == lg(p)
        if p in POW2:
            s, t = traffic("reduce", "rabenseifner", p, count, root=root)
            v = (np.arange(p) - root) % p
            gathered = np.where(v == 0, 0, subtree(p, v)) * n // p
            assert (t["sent_bytes"] == (p - 1) * n // p + gathered).all()
            assert t["recv_messages"][root] == 2 * lg(p)


@pytest.mark.parametrize("p", PS)
def test_traffic_all_gather_reduce_scatter(p):
    """Seed 004: N(P−1) per rank — (p−1)·n bytes for a per-rank block of n."""
    count, n = 5, 20
    p2 = 1 << (p.bit_length() - 1)
    for coll, algs in (("all_gather", {"ring": p - 1, "direct": p - 1, "bruck": lg(p),
                                      "recursive_doubling": lg(p)}),
                       ("reduce_scatter", {"ring": p - 1, "direct": p - 1,
                                           "recursive_halving": lg(p)})):
        for alg, msgs in algs.items():
            s, t = traffic(coll, alg, p, count)
            if alg in ("recursive_doubling", "recursive_halving") and p != p2:
                continue
            assert (t["sent_messages"] == msgs).all(), (coll, alg)
            assert (t["sent_bytes"] == (p - 1) * n).all(), (coll, alg)


@pytest.mark.parametrize("p", PS)
def test_traffic_all_to_all(p):
    count, n = 3, 12
    for alg in ("pairwise", "direct"):
        s, t = traffic("all_to_all", alg, p, count)
        assert (t["sent_messages"] == p - 1).all() and (t["sent_bytes"] == (p - 1) * n).all()
    s, t = traffic("all_to_all", "bruck", p, count)
    hops = sum(bin(j).count("1") for j in range(p))    # block for rank i+j travels popcount(j) hops
    assert (t["sent_messages"] == lg(p)).all() and (t["sent_bytes"] == hops * n).all()
    rng = np.random.default_rng(p)
    splits = rng.integers(0, 9, (p, p))
    for alg in ("pairwise", "direct"):
        s, t = traffic("all_to_all", alg, p, 0, splits=splits.tolist())
        assert (t["sent_bytes"] == 4 * (splits.sum(axis=1) - splits.diagonal())).all()
        assert (t["recv_bytes"] == 4 * (splits.sum(axis=0) - splits.diagonal())).all()


@pytest.mark.parametrize("p", PS)
def test_traffic_gather_scatter_barrier(p):
    count, n = 6, 24
    for root in {0, p - 1}:
        for coll in ("gather", "scatter"):
            at_root = "recv" if coll == "gather" else "sent"
            s, t = traffic(coll, "direct", p, count, root=root)
            assert t[f"{at_root}_messages"][root] == p - 1 and s.messages == p - 1
            assert t[f"{at_root}_bytes"][root] == (p - 1) * n
            s, t = traffic(coll, "binomial", p, count, root=root)
            assert t[f"{at_root}_messages"][root] == lg(p) and s.messages == p - 1
            assert t[f"{at_root}_bytes"][root] == (p - 1) * n
            assert t["sent_bytes"].sum() == sum(int(subtree(p, v)) for v in range(1, p)) * n
    s, t = traffic("barrier", "dissemination", p, 0)
    assert (t["sent_messages"] == lg(p)).all() and t["sent_bytes"].sum() == 0
    assert len(s.rounds) == lg(p)


@pytest.mark.parametrize("collective,algorithm", CASES)
def test_zero_size_messages_are_kept(collective, algorithm):
    """Which messages move does not depend on count (only segments may)."""
    for p in (3, 4, 6):
        kw = dict(hosts=(0, 0, 1, 1, 1, 2)[:p] if algorithm == "hierarchical" else None)
        if collective == "all_to_all_single":
            kw["splits"] = [[0] * p] * p
        empty = build(collective, algorithm, p, 0, **kw)
        if collective == "all_to_all_single":
            kw["splits"] = [[7] * p] * p
        full = build(collective, algorithm, p, 1, **kw)   # 1 element: one segment too
        assert (empty.traffic()["sent_messages"] == full.traffic()["sent_messages"]).all()
        assert (empty.traffic()["recv_messages"] == full.traffic()["recv_messages"]).all()


@pytest.mark.parametrize("collective,algorithm", CASES)
def test_single_rank_sends_nothing(collective, algorithm):
    s = build(collective, algorithm, 1, 10, splits=[[10]] if collective == "all_to_all_single" else None)
    assert s.messages == 0
    s.validate()
    bufs, want = execute(s, np.float32, np.add, 1)
    assert_results(s, bufs, want)


# -- the catalog API ------------------------------------------------------------------------
def test_catalog_names():
    assert set(CATALOG["all_reduce"]) == {"naive_ring", "direct", "ring", "gloo_ring",
                                          "recursive_doubling", "rabenseifner", "tree",
                                          "double_tree", "hierarchical"}
    assert set(CATALOG["broadcast"]) == {"direct", "binomial", "dissemination", "pipeline",
                                         "scatter_allgather", "hierarchical"}
    assert set(CATALOG["reduce"]) == {"direct", "binomial", "dissemination", "rabenseifner",
                                      "gloo_ring"}
    assert set(CATALOG["all_gather"]) == {"ring", "recursive_doubling", "bruck", "direct",
                                          "hierarchical"}
    assert set(CATALOG["reduce_scatter"]) == {"ring", "recursive_halving", "direct", "hierarchical"}
    assert set(CATALOG["all_to_all"]) == set(CATALOG["all_to_all_single"]) == {"pairwise", "bruck", "direct"}
    assert set(CATALOG["gather"]) == set(CATALOG["scatter"]) == {"direct", "binomial",
                                                                 "dissemination"}
    assert set(CATALOG["barrier"]) == {"dissemination"}
    for table in CATALOG.values():
        for builder in table.values():
            assert "T =" in builder.__doc__ or "T ≈" in builder.__doc__, builder


def test_build_is_cached_and_checks_arguments():
    a = build("all_reduce", "ring", 4, 1000)
    assert build("all_reduce", "ring", 4, 1000) is a
    h = build("all_reduce", "hierarchical", 4, 8, hosts=[0, 0, 1, 1])
    assert build("all_reduce", "hierarchical", 4, 8, hosts=(0, 0, 1, 1)) is h and h.hosts == (0, 0, 1, 1)
    assert build("all_reduce", "ring", 4, 8, hosts=(0, 0, 1, 1)) is build("all_reduce", "ring", 4, 8)
    with pytest.raises(ValueError, match="all_reduce.*broadcast"):
        build("allreduce", "ring", 4, 10)
    with pytest.raises(ValueError, match="naive_ring.*hierarchical"):
        build("all_reduce", "rings", 4, 10)
    with pytest.raises(ValueError):
        build("all_reduce", "ring", 0, 10)
    with pytest.raises(ValueError):
        build("all_reduce", "ring", 4, -1)
    for root in (-1, 4):
        with pytest.raises(ValueError, match="root"):
            build("broadcast", "binomial", 4, 10, root=root)
    with pytest.raises(ValueError):
        build("all_reduce", "hierarchical", 4, 10, hosts=(0, 1))
    with pytest.raises(ValueError):
        build("all_to_all", "direct", 2, 0, splits=[[1, 2]])
    with pytest.raises(ValueError):
        build("all_to_all", "direct", 2, 0, splits=[[1, -2], [0, 0]])
    with pytest.raises(ValueError):
        build("all_reduce", "ring", 2, 4, splits=[[1, 1], [1, 1]])
    s = build("all_to_all", "bruck", 3, 0, splits=[[1, 2, 3], [0, 0, 4], [5, 0, 1]])
    assert s.splits == ((1, 2, 3), (0, 0, 4), (5, 0, 1))
    assert s.buffers["in"] == 6 and s.buffers["out"] == 8


def test_printing_shows_rounds_and_transfers():
    text = str(build("all_reduce", "ring", 4, 1000))
    assert "all_reduce/ring" in text and "round 0:" in text and "round 5:" in text
    assert "r1.buf[0:250] += r0.buf[0:250]" in text
    assert "r1.buf[250:500] <- r0.buf[250:500]" in text     # all-gather step 1 passes chunk 1


def test_reference_round_semantics():
    """Local steps run first; messages read their sources after them, all at once."""
    s = Schedule("all_reduce", "test", 2, 2, buffers={"buf": 2, "tmp": 2})
    rnd = s.round()
    rnd.copy(src=0, dst=0, n=2, sbuf="buf", soff=0, dbuf="tmp", doff=0)       # local, first
    rnd.copy(src=0, dst=1, n=2, sbuf="tmp", soff=0, dbuf="tmp", doff=0)       # sees it
    rnd.copy(src=1, dst=0, n=1, sbuf="buf", soff=0, dbuf="buf", doff=1)
    s.round().reduce(src=1, dst=1, n=2, sbuf="tmp", soff=0, dbuf="buf", doff=0)
    s.validate()
    bufs = run(s, [{"buf": np.array([1., 2.])}, {"buf": np.array([10., 20.])}])
    assert bufs[0]["buf"].tolist() == [1, 10] and bufs[1]["buf"].tolist() == [11, 22]


def test_rl_schedule_runs_with_its_defaults_for_every_collective():
    """rl.schedule(c, p, count) for every collective: the usual algorithm, and "auto" the
    cost model's pick at that size (its default was "ring", which 7 of 10 have not)."""
    import ringlet as rl
    from ringlet.cost import choose, nbytes_of
    from ringlet.cost.model import DEFAULT_ALGORITHM
    from ringlet.cost.tune import priced_size
    for c in CATALOG:
        assert rl.schedule(c, 4, 16, splits=[[1] * 4] * 4 if c == "all_to_all_single"
                           else None).algorithm == DEFAULT_ALGORITHM[c]
        # priced as a call is: at the size auto rounds to, an uneven all-to-all at its mean
        # block (34047 elements: auto prices 557056 B, where ring and recursive doubling part)
        count, splits = (0, [[1 << 20] * 4] * 4) if c == "all_to_all_single" else (34047, None)
        mean = 1 << 20 if splits else count
        picked = rl.schedule(c, 4, count, algorithm="auto", splits=splits).algorithm
        assert picked == choose(c, priced_size(nbytes_of(c, 4, mean, 4)), 4)[0], c
    two_hosts = choose("all_reduce", 4 << 20, 4, hosts=(0, 0, 1, 1))[0]
    assert rl.schedule("all_reduce", 4, 1 << 20, algorithm="auto",
                       hosts=[0, 0, 1, 1]).algorithm == two_hosts
    with pytest.raises(ValueError, match="unknown collective"):
        rl.schedule("allreduce", 4, 16)
