"""Tracing: per-rank records of calls and messages, merged into one Perfetto timeline,
and a summary that names the rank everyone waited for."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import ringlet as rl
from ringlet import timeline
from ringlet.cost import predict_host, predict_p2p
from conftest import run, until_asleep


def _mixed_job(rank, straggler):
    pair = rl.new_group([0, 1])
    for size, algo in ((8, "auto"), (2 << 20, "ring")):   # C fast path; streamed by RTS
        if rank == straggler:                        # the slow rank of the job: it comes
            until_asleep([r for r in range(3) if r != rank])    # once the others wait
        x = np.ones(size // 4, np.float32)
        rl.all_reduce(x, algorithm=algo)
        assert x[0] == 3
    y = rl.empty(1 << 20, np.float32)                # 4 MiB: read in place
    y[:] = 1
    rl.all_reduce(y, algorithm="ring")
    assert y[0] == 3
    w = rl.all_gather(np.zeros((3, 1000), np.int32), np.full(1000, rank, np.int32),
                      async_op=True)
    w.wait()
    if rank < 2:
        z = np.ones(10, np.float64)
        rl.all_reduce(z, group=pair)


def _half_job(rank):
    from ringlet import ops
    x = np.zeros(1 << 20, ops.BFLOAT16)           # 2 MiB of bfloat16
    ops.fill(x, 1)
    rl.all_reduce(x, algorithm="ring")
    rl.all_reduce(np.ones(1 << 19, np.float32), algorithm="ring")    # the same bytes


def test_a_16_bit_reduction_is_traced_at_its_own_price(tmp_path):
    """A trace names each call's dtype and prices a bfloat16 reduction as the model does
    (its reduce costs more than float32's of the same bytes)."""
    out = tmp_path / "half"
    run(_half_job, 2, env={"RINGLET_TRACE": str(out)})
    for d in _read(out).values():
        half, single = d["calls"]
        assert (half["dtype"], single["dtype"]) == ("bfloat16", "float32")
        assert half["predicted"] == predict_host("all_reduce", 2 << 20, 2, "ring",
                                                 dtype="bfloat16")
        assert single["predicted"] == predict_host("all_reduce", 2 << 20, 2, "ring")
        assert half["predicted"] > single["predicted"]


def _cma_job(rank):
    x = np.full((2, 1 << 20), rank, np.float32)
    y = np.empty_like(x)
    rl.all_to_all(y, x)                         # 4 MiB blocks, both ways: read by CMA
    assert (y[1 - rank] == 1 - rank).all()
    z = np.ones(1 << 21, np.float32)
    rl.reduce_scatter(np.empty(1 << 20, np.float32), z, algorithm="ring")   # reduced: not


def test_messages_read_by_cma_are_traced_so(tmp_path):
    """In the Python engine an exchange's plain 4 MiB message is read whole by CMA, and
    the trace says so; one its receiver reduces streams (cma.py: it declines the read)."""
    from ringlet.transport import cma
    out = tmp_path / "cma"
    run(_cma_job, 2, env={"RINGLET_TRACE": str(out), "RINGLET_NO_FASTPATH": "1"})
    # (RINGLET_CMA=0, or a libc without process_vm_readv: it waits for CTS instead)
    way = "read by CMA" if cma.enabled() else "rendezvous"
    for d in _read(out).values():
        paths = {(c, m["bytes"], m["path"]) for c in ("all_to_all", "reduce_scatter")
                 for m in d["msgs"] if m["ev"] == "send" and m["seq"] == (
                     [x["seq"] for x in d["calls"] if x["coll"] == c][0])}
        assert paths == {("all_to_all", 4 << 20, way),
                         ("reduce_scatter", 4 << 20, "rendezvous")}, paths


def _read(d):
    return timeline.load(str(d))


def test_every_call_and_message_is_recorded_and_merged(tmp_path):
    out = tmp_path / "tr"
    run(_mixed_job, 3, -1, env={"RINGLET_TRACE": str(out)})
    ranks = _read(out)
    assert sorted(ranks) == [0, 1, 2]
    for r, d in ranks.items():
        calls = [(c["coll"], c["group"], c["bytes"]) for c in d["calls"]]
        world = [c for c in calls if c[1] == "world"]
        assert world == [("all_reduce", "world", 8), ("all_reduce", "world", 2 << 20),
                         ("all_reduce", "world", 4 << 20), ("all_gather", "world", 12000)]
        assert len(calls) == (5 if r < 2 else 4)
        for c in d["calls"]:
            assert c["end_us"] >= c["start_us"] and c["waited"] >= 0 and c["predicted"] > 0
        # the model priced each call at its size (all_gather: the whole output, p blocks)
        gathered = [c for c in d["calls"] if c["coll"] == "all_gather"][0]
        assert gathered["predicted"] == predict_host("all_gather", 12000, 3, gathered["algo"])
        in_place = [c for c in d["calls"] if c["bytes"] == 4 << 20][0]    # from rl.empty
        assert in_place["predicted"] == predict_host("all_reduce", 4 << 20, 3, "ring",
                                                     shared=("buf",))
        assert in_place["predicted"] != predict_host("all_reduce", 4 << 20, 3, "ring")
        seqs = [c["seq"] for c in d["calls"] if c["group"] == "world"]
        assert seqs == sorted(seqs) and len(set(seqs)) == 4
    paths = {m["path"] for d in ranks.values() for m in d["msgs"] if m["ev"] == "send"}
    assert {"read in place", "C fast path"} <= paths
    assert "streamed" in paths
    doc = timeline.merge(str(out))
    ev = doc["traceEvents"]
    sends = sum(m["ev"] == "send" for d in ranks.values() for m in d["msgs"])
    recvs = sum(m["ev"] == "recv" for d in ranks.values() for m in d["msgs"])
    assert sends == recvs > 0
    starts = [e for e in ev if e["ph"] == "s"]
    ends = [e for e in ev if e["ph"] == "f"]
    assert len(starts) == len(ends) == sends         # every send has its arrow to its receive
    assert {e["id"] for e in starts} == {e["id"] for e in ends}
    assert {e["pid"] for e in ev} == {0, 1, 2}
    calls = [e for e in ev if e.get("cat") == "call"]
    assert len(calls) == 14 and all("predicted_us" in e["args"] for e in calls)
    assert len([e for e in ev if e.get("cat") == "predicted"]) == 14
    assert not any("(?)" in e.get("name", "") for e in ev)   # every receive knows its path
    json.dumps(doc)


def test_summary_names_the_straggler(tmp_path):
    out = tmp_path / "tr"
    run(_mixed_job, 3, 2, env={"RINGLET_TRACE": str(out)})
    text = timeline.summary(str(out))
    first = [line for line in text.splitlines() if line.startswith("all_reduce #1 ")][0]
    assert first.endswith(")") and "last in: rank 2" in first
    assert re.search(r"rank 0 waited on rank 2 for", text)
    assert re.search(r"rank 1 waited on rank 2 for", text)
    lead = text.split("a straggler leads):\n")[1].splitlines()[0]
    assert lead.startswith("  rank 2:")
    # the ring call: rank 1 hears from rank 0, which waits for rank 2 - both wait on rank 2
    ring = text.split("all_reduce #2 of world (ring")[1].split("\nall_reduce #3")[0]
    assert re.search(r"rank 0 waited on rank 2 for", ring), ring
    assert re.search(r"rank 1 waited on rank 2 for [\d.]+ ms( \(its last message from "
                     r"rank 0\))?", ring), ring
    # Perfetto shows the straggler on every rank's bar of the call, not only whose message
    # ended the wait
    calls = [e for e in timeline.merge(str(out))["traceEvents"] if e.get("cat") == "call"
             and e["args"].get("group") == "world" and e["args"].get("seq") == 2]
    assert len(calls) == 3 and {e["args"]["last_in_rank"] for e in calls} == {2}
    assert all(e["args"]["last_in_after_first_us"] > 0 for e in calls)


def _block_job(rank, d):
    x = np.ones(4, np.float32)
    rl.all_reduce(x)                 # before the block: not recorded
    with rl.trace(d):
        rl.broadcast(x, 0)
        rl.barrier()
    rl.all_reduce(x)                 # after: not recorded


def test_trace_block_records_only_inside_it(tmp_path):
    d = tmp_path / "blk"
    run(_block_job, 2, str(d))
    ranks = _read(d)
    for r in (0, 1):
        assert [c["coll"] for c in ranks[r]["calls"]] == ["broadcast", "barrier"]


def test_ringlet_run_trace_and_cli(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import numpy as np, ringlet as rl\nrl.init()\n"
                      "x = np.ones(1000, np.float32)\nrl.all_reduce(x)\nrl.destroy()\n")
    d = tmp_path / "tr"
    cli = [sys.executable, "-m", "ringlet.cli"]
    p = subprocess.run(cli + ["run", "-n", "2", "--trace", str(d), str(script)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(d)) == ["rank0.jsonl", "rank1.jsonl"]
    job = tmp_path / "job.json"
    p = subprocess.run(cli + ["trace", "merge", str(d), "-o", str(job)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(job.read_text())["traceEvents"]
    p = subprocess.run(cli + ["trace", "summary", str(d)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "all_reduce #1 of world" in p.stdout
    png = tmp_path / "timeline.png"
    p = subprocess.run(cli + ["trace", "plot", str(d), "-o", str(png)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and "2 ranks, 2 calls, 2 messages" in p.stdout, p.stdout + p.stderr
    import matplotlib.image
    img = matplotlib.image.imread(png)
    assert img.shape[0] > 150 and img.shape[1] > 600 and img[..., :3].std() > 0.05
    p = subprocess.run(cli + ["trace", "summary", str(tmp_path / "nothing")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no rank*.jsonl" in p.stderr


def test_timeline_labels_of_calls_close_together_are_one(tmp_path):
    """Three quick calls, then one much later: their labels had printed over each other
    ("#1#2#3"); calls closer than 1/60 of the timeline share one label, "#1-3". A
    subgroup's call among them keeps its own number (it had made the world's "#1-2" and
    the subgroup's #1 read "#1-1" or "#1-3")."""
    script = tmp_path / "job.py"
    script.write_text("import time, numpy as np, ringlet as rl\nrl.init()\nx = np.ones(4)\n"
                      "g = rl.new_group([1, 0])\n"
                      "for _ in range(2):\n    rl.all_reduce(x)\nrl.all_reduce(x, group=g)\n"
                      "rl.all_reduce(x)\ntime.sleep(0.5)\n"
                      "rl.all_reduce(x)\nrl.destroy()\n")
    d, svg = tmp_path / "tr", tmp_path / "t.svg"
    cli = [sys.executable, "-m", "ringlet.cli"]
    for args in (["run", "-n", "2", "--trace", str(d), str(script)],
                 ["trace", "plot", str(d), "-o", str(svg)]):
        p = subprocess.run(cli + args, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
    text = svg.read_text()
    # (whether #3 joins the first label depends on how long the calls took)
    assert text.count("<!-- #1-") == 2 and text.count("group1[1, 0] #1 ") == 2
    assert "#4" in text and "#2" not in text


def test_tracing_off_by_default():
    from ringlet import tracing
    assert tracing.ON is False and callable(rl.trace)


def _p2p_job(rank, slow):
    import time
    n = rl.get_world_size()
    small, big = np.full(10, rank, np.float64), np.full(1 << 20, rank, np.float32)
    got = np.empty_like(small)
    if rank == 0:                                    # blocking: C fast path, then rendezvous
        rl.send(small, 1, tag=1)
        rl.send(big, 1, tag=2)
    elif rank == 1:
        rl.recv(got, 0, tag=1)
        b = np.empty_like(big)
        rl.recv(b, 0, tag=2)
        assert got[0] == 0 and b[-1] == 0
    right, left = (rank + 1) % n, (rank - 1) % n
    if rank == slow:
        time.sleep(0.5)                              # its right neighbour waits for it
    reqs = [rl.irecv(got, left, tag=7), rl.isend(small, right, tag=7)]   # a ring of isend/irecv
    for w in reqs:
        w.wait()
    assert got[0] == left


def test_point_to_point_is_traced_with_arrows(tmp_path):
    out = tmp_path / "p2p"
    run(_p2p_job, 3, 2, env={"RINGLET_TRACE": str(out)})
    ranks = _read(out)
    ops = {r: [(c["coll"], c["peer"], c["user_tag"], c["bytes"]) for c in d["calls"]]
           for r, d in ranks.items()}
    assert sorted(ops[0]) == sorted([("irecv", 2, 7, 80), ("isend", 1, 7, 80),
                                     ("send", 1, 1, 80), ("send", 1, 2, 4 << 20)])
    assert sorted(ops[1]) == sorted([("irecv", 0, 7, 80), ("isend", 2, 7, 80),
                                     ("recv", 0, 1, 80), ("recv", 0, 2, 4 << 20)])
    assert sorted(ops[2]) == sorted([("irecv", 1, 7, 80), ("isend", 0, 7, 80)])
    for d in ranks.values():
        for c in d["calls"]:
            assert c["algo"] == "point-to-point" and c["seq"] is None and c["predicted"] > 0
            # one message, as a send meets the transport (its limits, whole)
            assert c["predicted"] == pytest.approx(predict_p2p(c["bytes"]))
            assert c["end_us"] >= c["start_us"] and c["waited"] >= 0
    sends = sorted((r, m["peer"], m["bytes"], m["path"]) for r, d in ranks.items()
                   for m in d["msgs"] if m["ev"] == "send")
    assert [s[:3] for s in sends] == [(0, 1, 80), (0, 1, 80), (0, 1, 4 << 20), (1, 2, 80),
                                      (2, 0, 80)]
    # 4 MiB from a plain buffer: past the ring's size, offered by CMA (the kernel willing)
    assert sends[2][3] in ("offered by CMA", "rendezvous") and \
        "C fast path" in {s[3] for s in sends}
    doc = timeline.merge(str(out))
    ev = doc["traceEvents"]
    starts = {e["id"]: e for e in ev if e["ph"] == "s"}
    ends = {e["id"]: e for e in ev if e["ph"] == "f"}
    assert len(starts) == len(ends) == 5 and starts.keys() == ends.keys()
    ring = sorted((starts[i]["pid"], ends[i]["pid"]) for i in starts)
    assert ring == [(0, 1), (0, 1), (0, 1), (1, 2), (2, 0)]    # each arrow from sender to receiver
    assert all(ends[i]["ts"] >= starts[i]["ts"] for i in starts)
    names = [e["name"] for e in ev if e.get("cat") == "call"]
    assert "send -> r1 (4 MiB, tag 2)" in names and "irecv <- r2 (80 B, tag 7)" in names
    assert not any("(?)" in e.get("name", "") for e in ev)
    text = timeline.summary(str(out))
    assert "point-to-point, per rank and peer (10 calls):" in text
    assert re.search(r"rank 0 received from rank 2: 1 message, 80 B; waited on rank 2 for "
                     r"[\d.]+ ms", text)
    lead = text.split("a straggler leads):\n")[1].splitlines()[0]
    assert lead.startswith("  rank 2:")               # the late rank leads


def test_summary_of_a_failed_job_names_the_missing_rank_and_the_failed_call(tmp_path):
    """The summary of a job where a rank died read like a healthy one: 'last in' named a
    rank among those that had come, nothing said a rank was missing or that calls failed,
    and a trace cut off mid-line (its rank killed as it wrote) stopped every command."""
    script = tmp_path / "job.py"
    script.write_text("import os, numpy as np, ringlet as rl\nrl.init()\nx = np.ones(4)\n"
                      "rl.all_reduce(x)\nrl.barrier()\n"
                      "if rl.get_rank() == 2:\n    os._exit(0)\n"
                      "try:\n    rl.all_reduce(x, timeout=20)\nexcept rl.RingletError:\n"
                      "    pass\n")
    d = tmp_path / "tr"
    cli = [sys.executable, "-m", "ringlet.cli"]
    subprocess.run(cli + ["run", "-n", "3", "--trace", str(d), str(script)],
                   capture_output=True, text=True, timeout=60)
    assert sorted(os.listdir(d)) == ["rank0.jsonl", "rank1.jsonl"]
    with open(d / "rank0.jsonl", "a") as f:
        f.write('{"ev": "call", "coll": "all_re')          # cut off mid-line
    p = subprocess.run(cli + ["trace", "summary", str(d)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert "rank(s) [2] of the job's 3 left no trace" in p.stdout, p.stdout
    assert "failed: all_reduce #3 of world on rank(s) [0, 1]" in p.stdout, p.stdout
    assert "entered by 2 of its 3 ranks only" in p.stdout and "rank 0 failed: " in p.stdout


def _timed_out_job(rank):
    x = np.ones(1 << 16, np.float32)             # 256 KiB: not one packet
    if rank == 1:
        time.sleep(1.5)                          # (rank 0 has given the call up)
    try:
        rl.all_reduce(x, algorithm="ring", timeout=0.8 if rank == 0 else 20)
    except rl.RingletError:
        pass
    rl.barrier(timeout=30)


def test_a_timed_out_call_records_the_time_it_waited(tmp_path):
    """A call that timed out recorded as waited only its rounds that had finished (7.5 ms
    of a 3.3 s timeout): the round it was waiting in when its time ran out now counts."""
    out = tmp_path / "tr"
    run(_timed_out_job, 2, env={"RINGLET_TRACE": str(out)})
    calls = [c for c in _read(out)[0]["calls"] if c["coll"] == "all_reduce"]
    assert len(calls) == 1 and calls[0].get("error"), calls
    assert calls[0]["waited"] >= 0.7, calls
