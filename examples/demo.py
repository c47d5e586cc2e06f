"""ringlet's main demonstration: run it with `ringlet run -n 4 examples/demo.py`.

Every rank runs this file; rank 0 narrates. It walks the substrate (ranks, send/recv,
isend/irecv, subgroups), rebuilds the naive hand-written ring all-reduce from send/recv and
checks its message count, then runs every collective against a NumPy reference, shows
a schedule, and prices the same algorithms with the cost model.
"""
import time

import numpy as np

import ringlet as rl
from ringlet.bench import alternating_blocks


def say(*args):
    if rl.get_rank() == 0:
        print(*args, flush=True)


def main():
    rl.init()
    rank, K = rl.get_rank(), rl.get_world_size()
    say(f"== ringlet demo: {K} ranks, world formed (rank 0 of {K} speaking)\n")

    # -- 1. point-to-point: send/recv, isend/irecv around a ring ------------------------------
    x = np.full(4, float(rank))
    got = np.empty(4)
    right, left = (rank + 1) % K, (rank - 1) % K
    w_send, w_recv = rl.isend(x, right), rl.irecv(got, left)
    w_send.wait(), w_recv.wait()
    assert (got == left).all()
    if rank == 0:
        rl.send(np.array([42.0]), 1, tag=3)
    elif rank == 1:
        msg = np.empty(1)
        rl.recv(msg, 0, tag=3)
        assert msg[0] == 42.0
    say("1. point-to-point: every rank isend()s to its right neighbour and irecv()s from its "
        "left;\n   rank 0 send()s 42.0 to rank 1 with tag 3 — all arrived intact")

    # -- 2. the naive ring all-reduce, built by hand from send/recv -----------------------------
    # (whole vectors: a running sum walks the ring, then the total walks it again; the real
    # ring of section 5 slices each vector into K chunks, so each message carries n/K)
    rng = np.random.default_rng(0)
    local = [rng.integers(1, 10, size=3) for _ in range(K)]
    rl.reset_stats()
    acc = local[rank].copy()
    if rank > 0:
        rl.recv(acc, rank - 1)
        acc += local[rank]
    if rank < K - 1:
        rl.send(acc, rank + 1)
    if rank == K - 1:
        rl.send(acc, 0)
    else:
        rl.recv(acc, K - 1 if rank == 0 else rank - 1)
        if rank < K - 2:
            rl.send(acc, rank + 1)
    sent = np.array([sum(v["messages"] for v in rl.stats()["sent"].values())])
    rl.all_reduce(sent)
    say("\n2. the naive ring all-reduce, by hand with send/recv only (a running sum walks the "
        "ring,\n   then the total walks it again; section 5 shows the real ring, in chunks):")
    for r in range(K):
        say(f"     rank {r}: {local[r]}")
    say(f"   point-to-point messages sent : {sent[0]}  (= 2*(K-1) for K={K}, in all)")
    say(f"   every rank holds the sum?    : {np.array_equal(acc, np.sum(local, axis=0))}"
        f"  {acc}")

    # -- 3. subgroups: data-parallel x tensor-parallel on one world ------------------------------
    half = K // 2 or 1
    tp_groups = [rl.new_group(list(range(i, min(i + half, K)))) for i in range(0, K, half)]
    dp_groups = [rl.new_group(list(range(i, K, half))) for i in range(half)]
    tp = next(g for g in tp_groups if g.rank >= 0)
    dp = next(g for g in dp_groups if g.rank >= 0)
    a, b = np.full(3, float(rank)), np.full(3, float(rank))
    works = [rl.all_reduce(a, group=tp, async_op=True), rl.all_reduce(b, group=dp, async_op=True)]
    for w in works:
        w.wait()
    say(f"\n3. subgroups: tensor-parallel {[list(g.ranks) for g in tp_groups]} and data-parallel "
        f"{[list(g.ranks) for g in dp_groups]}\n   every rank passes its own rank number; two "
        f"async all_reduces in flight at once:\n   rank 0 got tp-sum {a[0]:g} "
        f"(= {' + '.join(map(str, tp.ranks))}), dp-sum {b[0]:g} "
        f"(= {' + '.join(map(str, dp.ranks))})")

    # -- 4. every collective, checked against NumPy --------------------------------------------
    say("\n4. the collectives (checked on every rank against NumPy):")
    n = 10
    data = np.arange(K * n, dtype=np.float32).reshape(K, n) + 100 * rank
    ref_all = [np.arange(K * n, dtype=np.float32).reshape(K, n) + 100 * r for r in range(K)]
    checks = []
    buf = data[0].copy()
    rl.broadcast(buf, src=1 % K)
    checks.append(("broadcast", np.array_equal(buf, ref_all[1 % K][0])))
    buf = data[0].copy()
    rl.all_reduce(buf)
    checks.append(("all_reduce", np.array_equal(buf, sum(r[0] for r in ref_all))))
    buf = data[0].copy()
    rl.reduce(buf, dst=0)
    checks.append(("reduce", rank != 0 or np.array_equal(buf, sum(r[0] for r in ref_all))))
    out = np.empty((K, n), np.float32)
    rl.all_gather(out, data[0])
    checks.append(("all_gather", np.array_equal(out, np.stack([r[0] for r in ref_all]))))
    shard = np.empty(n, np.float32)
    rl.reduce_scatter(shard, data)
    checks.append(("reduce_scatter", np.array_equal(shard, sum(r[rank] for r in ref_all))))
    out = np.empty((K, n), np.float32)
    rl.all_to_all(out, data)
    checks.append(("all_to_all", np.array_equal(out, np.stack([r[rank] for r in ref_all]))))
    out = np.empty((K, n), np.float32) if rank == 0 else None
    rl.gather(data[0], out, dst=0)
    checks.append(("gather", rank != 0 or np.array_equal(out, np.stack([r[0] for r in ref_all]))))
    rl.scatter(shard, data if rank == 0 else None, src=0)
    checks.append(("scatter", np.array_equal(shard, ref_all[0][rank])))
    rl.barrier()
    ok = np.array([all(c for _, c in checks)], np.int32)
    rl.all_reduce(ok, op=rl.ReduceOp.MIN)
    say("   " + ", ".join(name for name, _ in checks) + ", barrier: "
        + ("all correct on every rank" if ok[0] else "MISMATCH"))

    # -- 5. one algorithm, three uses: run it, count it, price it ---------------------------------
    sched = rl.schedule("all_reduce", p=K, count=8, algorithm="ring")
    say(f"\n5. the ring all-reduce as a schedule (the only definition of the algorithm):\n{sched}")
    v = np.ones(1 << 20, np.float32)
    rl.barrier()
    rl.reset_stats()
    rl.all_reduce(v, algorithm="ring")
    st = rl.stats()["sent"]                      # read before the next call adds to them
    times = []
    for _ in range(7):      # (a call's first run also maps its buffers: time warm ones)
        rl.barrier()
        t = time.perf_counter()
        rl.all_reduce(v, algorithm="ring")
        times.append(time.perf_counter() - t)
    dt = np.array([np.median(times)])
    rl.all_reduce(dt, op=rl.ReduceOp.MAX)
    priced = rl.cost.predict("all_reduce", v.nbytes, K, algorithm="ring")
    fitted = ("calibrated" if rl.cost.load_profile().calibrated
              else "default profile: `ringlet calibrate` fits it")
    say(f"   4 MiB ring all_reduce: rank 0 sent {sum(s['messages'] for s in st.values())} messages "
        f"(2(p-1) = {2 * (K - 1)}), {sum(s['bytes'] for s in st.values())} bytes "
        f"(2(p-1)/p*n = {2 * (K - 1) * v.nbytes // K})")
    say(f"   slowest rank's median of 7 calls {dt[0] * 1e3:.2f} ms; priced {priced * 1e3:.2f} ms "
        f"by this host's model ({fitted})")
    say("   the same schedule priced on the usual interconnect tiers (64 MiB, 8 ranks):")
    for tier in ("nvlink", "infiniband", "ethernet"):
        t_ring = rl.cost.predict("all_reduce", 64 << 20, 8, algorithm="ring", link=rl.cost.TIERS[tier])
        say(f"     {tier:<11} ring all_reduce {t_ring * 1e3:8.2f} ms")

    # -- 6. zero-copy buffers: a local peer reads an rl.empty array in place ---------------------
    say("\n6. all_gather of 2 MiB per rank, from NumPy arrays and from rl.empty ones:")
    arms, made = {}, {}
    for kind, alloc in (("numpy   ", np.empty), ("rl.empty", rl.empty)):
        mine, every = alloc(1 << 19, np.float32), alloc((K, 1 << 19), np.float32)
        mine[...] = rank
        arms[kind] = (lambda every=every, mine=mine: rl.all_gather(every, mine), lambda: None)
        arms[kind][0]()
        made[kind] = (every, rl.stats()["collectives"]["all_gather"]["algorithm"])
    # the two kinds in turn, block by block, so a busy spell of the host hits both alike
    blocks = alternating_blocks(rl, arms, blocks=6, calls=5)
    for kind, (every, ran) in made.items():
        good = bool((every == np.arange(K, dtype=np.float32)[:, None]).all())
        say(f"   {kind} auto ran {ran:<18} {np.median(blocks[kind]) / 1e3:6.2f} ms (slowest "
            f"rank's median call, median of 6 blocks taken in turn){'' if good else '  WRONG RESULT'}")
    say("\n== done: every call worked on every rank")
    rl.destroy()


if __name__ == "__main__":
    main()
