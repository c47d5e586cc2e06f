"""The transports' size limits, in one place: the engine, the C fast path, the cost model
and calibration all read them from here.

Shared memory (shm.py): every direction of every local pair is a ring of RING_BYTES.

* RING_BYTES: small enough that a fragment is read back while still in cache (a sender
  runs at most a ring ahead of its receiver); the extra 128 B let two whole EAGER packets
  of 512 KiB fit, headers included. RINGLET_SHM_RING overrides it.
* SHM_EAGER_BYTES: up to half the ring a message goes as one packet, without the RTS/CTS
  round trip, which only pays when the data needs several fragments anyway; and a call of
  EAGER packets can run in C (fast.py).
* SHM_FRAG_BYTES: the largest DATA fragment of a longer message (a quarter of the ring).
* SHM_PIECE_BYTES, SHM_PIECES: a collective's message of more than two pieces (128 KiB, up
  to SHM_EAGER_BYTES) to a local peer, from a sender that receives nothing in its round (a
  root's, a tree's), goes as ceil(bytes / SHM_PIECE_BYTES) EAGER packets, at most
  SHM_PIECES (``pieces``; collectives._pieces_of applies it to the compiled plan, from the schedule,
  so both ends, in C or the Python engine, send and expect the same packets): its
  receiver copies one piece out while its sender copies the next in, where one packet
  made the receiver wait for the whole copy in. In-job A/B (pieces of 128 KiB / 64 KiB
  against whole packets, 10 block pairs, quiet): at p = 2 scatter 1 MiB 1.70x / 1.72x
  faster, broadcast 1 MiB 1.61x / 1.68x, reduce 256 KiB 1.37x / 1.67x, gather 1 MiB
  1.21x; messages of 128 KiB (a 256 KiB scatter's) no faster in pieces (0.99x). This rule
  (pieces of 64 KiB, at most 4) against pieces of 128 KiB: scatter p = 2 512 KiB 1.17x,
  reduce and broadcast 256 KiB 1.13-1.14x, 1 MiB rows 0.98-1.02x. Exchanges (all_gather,
  all_to_all: both cores copy anyway) ran 0.95x in pieces at p = 2 all_to_all 1 MiB, so
  their messages stay whole; at p = 4 on 2 cores 0.91-1.23x, noise
  (bench/eager_pieces.py). Point-to-point messages stay whole (a send and its receive may
  run on different paths, which must agree on the packets).
* SHM_STREAM_BYTES: up to the ring's size a larger message's DATA follows its RTS at once
  (a receiver not ready parks it, bounded as an eager one is).
* ZERO_COPY_MIN: above it, a send from an rl.empty buffer, in a round where its sender
  receives too, is read in place by the receiver: one copy instead of two through the
  ring. Not below: an EAGER packet through the C fast path beats one copy fewer plus the
  RTS round trip. ZERO_COPY_ONEWAY_MIN: the same for a sender that only sends in its
  round (a broadcast's root, point-to-point). An rl.empty message below these takes the
  plain path, exactly as a NumPy buffer's. Both sit at one EAGER packet: past it a message
  goes by RTS anyway, and one copy fewer wins. Measured at p = 2 on the Intel Xeon VM
  (2026-12-06; p2p-sized messages, bench/inplace_threshold.py, same rl.empty buffers, both
  paths in alternating blocks, load 1.6): in place / plain on the median block, one-way
  512 KiB 1.00 (an EAGER packet either way), 768 KiB 0.70, 1 MiB 0.49, 2 MiB 0.44; exchange
  (all_to_all) 768 KiB 0.72, 1 MiB 0.71. In collectives (bench/algorithms_vs_mpi.py --knob
  zc_oneway_min=524288, against 896 KiB, rl.empty): broadcast p = 2 640-896 KiB 0.89-0.93,
  scatter p = 2 1.25-1.75 MiB 0.57-0.61. On the AMD EPYC VMs before it the one-way limit
  was 896 KiB, where the plain path had let a sender go on as soon as its copy was in the
  ring (one-way 768 KiB 1.52, 896 KiB 1.45, 1 MiB 0.90; exchange 512 KiB 1.03, 640 KiB
  0.82, load 3.6): a core there read another's fresh lines faster than this one does.
  ZERO_COPY_P2P_MIN: a point-to-point send keeps the limits it had, 896 KiB from rl.empty
  (7/8 of the ring) and the ring's size from a plain buffer (no CMA below it): up to them
  a blocking send goes through the ring and completes without its receiver (a program
  whose ranks both send, then both receive, works up to there, as it did); past them it
  waits for the receiver to read it.
* SPLIT_MIN: from it, a one-way message read in place whose receive lies in an rl.empty
  buffer too is copied (or reduced) by both ends at once, the receiver from the front and
  the sender from the back, in SPLIT_CHUNK pieces each claims by compare-and-swap
  (split.py): with an idle sender, each end does about half; a sender busy elsewhere in
  its round (a scatter's root copying its own block) takes what is left when it gets to it.
  SPLIT_REDUCE_MIN: the same for a message its receiver reduces (dst = op(dst, message)),
  from a larger size: below it the receiver reducing alone was faster. In-job A/B (reduce
  p = 2, dissemination, rl.empty, fresh inputs, 8-10 alternating blocks of 10 calls, four
  jobs, load < 1; split / receiver alone on the median block): 1 MiB 1.07-1.36, 1.5 MiB
  0.96-1.18, 2 MiB 0.99-1.07, 3 MiB 1.03, 4 MiB 0.93-0.96, 8 MiB 0.68-0.82, 32 MiB 0.76.
  Copies split from SPLIT_MIN (broadcast p = 2, the same A/B: 1 MiB 0.92-1.16, 2 MiB
  0.92-0.99, 4 MiB 0.80).
  SPLIT_BUSY_MIN: where ranks outnumber cores, a sender with other copies in its round (a
  scatter's root, a direct broadcast's) offers its help only from this size: below it the
  help took a core from receivers waiting their turn for one, and each waited for the
  sender's last chunk. In-job A/B, bench/algorithms_vs_mpi.py --flag CROWDED_BUSY_HELP
  (rl.empty, 12 alternating blocks of 10 calls, quiet host; help / alone on the median
  block): scatter p = 4 8 MiB (2 MiB blocks) 1.14, 1.11, 1.20, 1.16; p = 3 1.28, 1.05;
  16 MiB 0.91, 0.95; 32 MiB 0.86, 0.97;
  broadcast direct p = 3, 4 at 2-3 MiB 1.01-1.19. Senders with nothing else to copy (a
  gather's leaves, a pipeline's root) help as before: broadcast p = 4 8 MiB (auto) without
  any help 1.06-1.20x slower.
* FAST_BYTES: the largest message of a call the C fast path runs: one EAGER packet.
* CMA_MIN: above it, a send from a plain (private) buffer to a local peer offers its
  address in the RTS (cma.py): one copy instead of two. From one EAGER packet: on the
  Intel Xeon VM a message past it, streamed through the ring (two copies, in the Python
  engine), ran 1.5x as long as read whole (bench/algorithms_vs_mpi.py --knob
  cma_min=524288,zc_oneway_min=524288 against 1 MiB + 128 B and 896 KiB, plain, 10
  alternating blocks, 2026-12-06; set / built on the median block): all_to_all p = 2
  1.5 MiB 0.66, 2 MiB 0.64 (Open MPI's time over ringlet's 0.57 -> 0.90), 3-4 MiB 1.00;
  all_gather p = 2 1.5-2 MiB 0.69; broadcast (direct) p = 2 640 KiB-1 MiB 0.79-0.87;
  scatter p = 2 1.25-2 MiB 0.84-0.89, p = 4 2.5-4 MiB 0.50-0.81; gather p = 2 1.25-2 MiB
  0.68-0.71, p = 4 0.78-0.89; neutral where nothing moves by it (reduce p = 2, 4 and
  broadcast p = 4, 640 KiB-1 MiB: 0.98-1.04). On the AMD EPYC VMs it was the ring's
  size, 1 MiB + 128 B: up to it a message streamed without the round trip the read
  needs, and that won there. In a round where the sender
  also receives, the receiver reads it whole with process_vm_readv; sent one-way, the
  sender writes a head into the receive buffer (process_vm_writev; p = 2: half) while
  the receiver reads the rest (CMA_PUT_MIN, the same limit; only where ranks do not
  outnumber cores: where they do, the receiver reads it whole, as in an exchange round).
  Taken only by a receive that copies (cma.py says why). Where ranks outnumber cores, an
  exchange's message is read whole from past one EAGER packet (SHM_EAGER_BYTES) whatever
  CMA_MIN is (protocol.CROWDED_EXCHANGE_CMA; the same limit now, measured first on AMD):
  streamed, both of its copies take CPU the ranks share, and a 1 MiB message with its
  headers overflows the ring, so its sender waits for the receiver to drain it. In-job A/B, bench/algorithms_vs_mpi.py --flag CROWDED_EXCHANGE_CMA
  (plain, 10 alternating blocks; read whole / streamed on the median block): all_to_all
  p = 4 3 MiB (768 KiB messages) 0.90, 0.80, 4 MiB 0.74, 0.68; p = 3 2 MiB 0.84, 3 MiB
  0.68; all_gather p = 4 3 MiB 0.91, 4 MiB 0.55; p = 3 2 MiB 0.89, 3 MiB 0.72. A
  receive that reduces declines it (neutral there: reduce_scatter, all_reduce p = 4 at
  3-4 MiB 0.95-1.04), so a message its receiver reduces is not offered at all
  (SendStep.reduce): up to the ring's size it streams without the round trip. Not from
  smaller messages, which go as EAGER packets, in C: all_to_all p = 4 with 384-512 KiB
  messages read whole ran 1.4-2.1x slower, with 256 KiB ones 2.1x (a patched tree, the same A/B) - read by the
  Python engine; read in C not faster either (bench/algorithms_vs_mpi.py --flag
  CROWDED_EAGER_CMA on a tree that had the switch, in blocks each prepared under its own
  setting, plain and rl.empty, p = 4 640 KiB-1.5 MiB: read whole / two copies 1.00-1.15
  for all_gather, 0.97-1.72 for all_to_all, slower in 11 of 12 rows; removed).

TCP (tcp.py): TCP_EAGER_BYTES, above which a message goes RTS/CTS/DATA, and
TCP_FRAG_BYTES, the largest DATA packet (and the receive bounce buffer). Each DATA packet
costs the receiver a wakeup and a Python turn and the sender a sendmsg (header and payload
in one call): 4 MiB packets took 10-15% less CPU per 64 MiB all_reduce between two
namespace hosts than 1 MiB (256 KiB: 10% more), measured as process time, which load
moves less than the clock (bench/hosts.py --gloo; tcp.py). No MSG_ZEROCOPY:
a bare 64 MiB exchange with it took 28-31 ms of CPU against 22-33 ms without (load 11):
the kernel copies the pages anyway when it hands them to a socket on this machine.

TCP_LANES: connections per pair of ranks on different hosts (a pair opens the fewer of
its two ranks' counts; RINGLET_TCP_LANES overrides it, 1-16). With more than one, a large
message's DATA is dealt round robin over them in pieces of up to TCP_FRAG_BYTES - down
to TCP_STRIPE_MIN, so that a message from twice that size crosses on several - and put
back by offset (tcp.py); control and small messages stay on the first. One by default:
on this 2-core machine it does not win. Two namespace hosts, one rank each, unshaped
veth, 1, 2 and 4 lanes turn by turn in one job (bench/tcp_streams.py --deals 1,2,4,
15 turns, load 6-8), median ms / CPU ms per call: all_reduce 8 MiB 20.2/7.7, 21.3/7.9,
19.2/7.5; 64 MiB 158/55, 159/52, 148/49; 256 MiB 666/212, 739/228, 744/239 (spread
+-50%). On a 1 Gbit/s tbf link (5 turns): 64 MiB 594, 583, 596 ms (90, 92, 90% of the
link); 256 MiB 2292, 2283, 2332 ms (94% each). A 256 MiB all_reduce of two ranks on two
cores is bound by CPU, not by the connection: per rank and call, between namespace hosts
(bench/tcp_streams.py, 9 turns, load 11; CPU ms, kernel + user): all_reduce 212 + 57,
the same bytes exchanged by ringlet without reducing 200 + 28, a bare exchange by
blocking threads 200 + 12. The kernel's copies cost all of them the same; ringlet's
extra is ~29 ms reducing and ~16 ms of Python and polling (a loopback profile: ~4 ms
in the Python of the packets themselves); more connections add CPU rather than take any away. (The
bare exchange's ceiling with 2 connections - bench/hosts.py --gloo, quiet machine: 136
against 203 ms - runs a thread per connection and direction: 4 threads per rank spread
the kernel's copies over both cores, and it does not reduce.) A link whose flows are
limited one by one (a real NIC's per-flow hashing, a long fat pipe) may still want more.

TCP_THREAD_MIN: a message from this many bytes up (the receiver's limit; RINGLET_TCP_THREADS,
0: never) crosses on a connection of its own per pair, written by a thread of the sender's
and read - and reduced - by a thread of the receiver's (tcp.Threads), while the engine
thread keeps control packets, small messages and matching. The kernel's copies are what a
large exchange costs here (above); with one thread per rank they run one at a time in
each rank, with these a rank's send and receive copies run at once and a rank asleep in
recv leaves its core to the peer's send. Two namespace hosts, one rank each, unshaped
veth, all_reduce with threads on/off turn by turn in one job (bench/tcp_streams.py --knob
thread_min=8388608,1099511627776 --gloo), median ms of 7-11 turns, four runs at load 15-28
(the machine shared with three other benchmarking sessions: spreads of 2-3x within a
cell), and a fifth at load 9: 256 MiB 587/1092, 728/994, 1150/1470, 1448/1455, 546/634;
64 MiB 294/313, 234/235, 200/278, 224/301, 165/168 (Gloo in that last run: 568 and 160 ms:
ringlet is ~1x Gloo on this crowded machine either way; the 2x of a quiet one is not
measurable here). On a quiet host they lose, so they are off by default (0): same job and
command, load 0.4-2.1, three runs, threads on/off (Gloo): 256 MiB 355/254 (326),
369/252 (338), 332/244 (331 - with RINGLET_IDLE_SPIN_US=0, so not the engine's spin
holding the GIL); 64 MiB 76/66 (83), 78/65 (82), 79/61 (85); the bare exchange without a
reduction loses alike (256 MiB 288-310/229-246). One thread per rank already has its core
there; the threads only help when other processes take the cores. On a 1 Gbit/s tbf link they keep the link's rate: 64 MiB 571/579 ms,
256 MiB 2282/2471 (94%/87% of the link; load 7-8). Threads cost CPU per message (a handoff, a wakeup, the GIL): 2 ranks
over loopback, process CPU per all_reduce (load 18-25) 8 MiB 8.6 against 6.2 ms, 32 MiB
28.4 against 24.4; so not below 8 MiB messages (a p = 2 all_reduce from 16 MiB), where
the wall time showed no gain either (8 MiB: 25.6/25.8 ms). The reader waits for a whole
chunk with MSG_WAITALL (11.0 ms of CPU per 8 MiB all_reduce reading as segments come).

TCP_REDUCE_CHUNK: a reducing DATA piece is read into the bounce buffer and applied this
much at a time, so NumPy reads it back from L2 (1 MiB here) rather than L3. Copy into a
bounce and add into a 128 MiB float32 array, process time (load 13): 4 MiB 37-53 ms,
1 MiB 31-43, 512 KiB 29-32, 256 KiB 27-33, 128 KiB 31-39. Between namespace hosts
it is lost in the noise (256 MiB all_reduce CPU 237/232/231 ms with 4 MiB/1 MiB/256 KiB,
bench/tcp_streams.py --knob chunk, load 12-15). The wire's piece stays TCP_FRAG_BYTES.

TCP_SNDBUF, TCP_RCVBUF: each connection's socket buffers (RINGLET_TCP_SNDBUF,
RINGLET_TCP_RCVBUF; 0: the kernel's autotuning, here up to 4 MiB to send and 32 MiB to
receive). Fresh jobs in turns (bench/tcp_streams.py --ab, 3 jobs x 5 turns each, load
6-10), all_reduce median ms / CPU ms, fixed 4 MiB both : autotuned both : 4 MiB send and
autotuned receive: 8 MiB 22.0/9.2 : 23.6/8.8 : 14.2/6.7; 64 MiB 190/60 : 244/53 :
170/48; 256 MiB 699/241 : 893/207 : 743/197. Autotuning costs less CPU in the kernel
(sys 146 against 190 ms at 256 MiB) but not less time; nothing here is clear of the
noise. The send buffer stays a fixed 4 MiB (8 MiB as the kernel counts them); the receive
buffer is the kernel's (TCP_RCVBUF = 0), because a fixed one drops data on a shaped link:
the kernel advertised more window than 8 MiB of buffer memory holds once tbf cut the
stream into MTU frames (more overhead per byte), then pruned and dropped what arrived,
and each drop cost its sender a retransmission timeout (200 ms at least, doubling while
it repeats). 64 MiB calls (rabenseifner, recursive halving) on namespace hosts at 1 Gbit/s,
200 us bucket (bench/tcp_stall.py --pair, load 17-20), per host, fixed : autotuned:
2 x 2, 8 calls: receiver drops 14-15 : 0, retransmission timeouts 13-15 : 0, segments
retransmitted 131-245 : 77-85; 2 x 4, 16 calls: drops 18-21 : 0, timeouts 18-21 : 0,
retransmitted 554-588 : 123-136 (slowest call 3.3 : 3.9 s, 1.9 : 1.8 s at 2 x 2); the
whole mix (8 collectives x 64M, 16M, 1M x 3, 2 x 2, 3 fresh jobs each in turns, load
15-21): drops 12-19 : 0, timeouts 10-18 : 0-1 per host and job, time no different (job
120-132 : 114-155 s, slowest call 4.1-5.2 : 3.5-5.7 s).
tests/test_tcp_stall.py checks that a shaped link drops nothing at the receiver.
"""
from __future__ import annotations

import os

RING_BYTES = (1 << 20) + 128
SHM_EAGER_BYTES = 512 << 10
SHM_FRAG_BYTES = 256 << 10
SHM_PIECE_BYTES = 64 << 10
SHM_PIECES = 4
PIECES_MAX_RANKS = 16
SHM_STREAM_BYTES = RING_BYTES
ZERO_COPY_MIN = SHM_EAGER_BYTES
ZERO_COPY_ONEWAY_MIN = SHM_EAGER_BYTES
ZERO_COPY_P2P_MIN = 896 << 10
SPLIT_MIN = 1 << 20
SPLIT_REDUCE_MIN = 4 << 20
SPLIT_CHUNK = 256 << 10
SPLIT_BUSY_MIN = 4 << 20
FAST_BYTES = SHM_EAGER_BYTES
CMA_MIN = SHM_EAGER_BYTES
CMA_PUT_MIN = CMA_MIN

TCP_EAGER_BYTES = 64 << 10
TCP_FRAG_BYTES = 4 << 20
TCP_LANES = 1
TCP_STRIPE_MIN = 1 << 20
TCP_REDUCE_CHUNK = 256 << 10
TCP_THREAD_MIN = 0          # off: slower on a quiet host (above); RINGLET_TCP_THREADS=8388608 on
TCP_SNDBUF = 4 << 20
TCP_RCVBUF = 0


def facts(fast_path: bool) -> dict:
    """What each transport does, as the cost model prices it: eager limit, the piece size
    of a one-way collective message up to it (``pieces``; 0: whole), above how many
    bytes a message waits for CTS, bytes a pair cycles through, above how many bytes a send
    from an rl.empty buffer is read in place (-1: never), above how many bytes a send from
    a plain buffer is read whole by CMA (-1: never; only in a round where the sender
    receives too, only into a receive that copies, and only where the kernel allows it:
    see cma.py), the same as zero_copy_min for a sender that does not receive in its round,
    above how many bytes a one-way send from a plain buffer is split by CMA
    (-1: never; only where ranks do not outnumber cores - where they do, it is read whole,
    priced as cma_min's - only into a receive that copies:
    the sender writes the first r/(s+r) of the bytes into the receive buffer while the
    receiver reads the rest, each at the kernel's copy speed, beta + beta_cma per byte,
    the two at once; s: the large messages the sender's round sends, plus its local copies
    where they wait for them (a scatter's root), r: the messages the receiver's round
    receives; so a broadcast at p = 2 halves it, a scatter's root at p = 2 writes a
    third: cma.py), from how many bytes a one-way message read in place into an rl.empty
    buffer is copied by both its ends (-1: never; C does the claiming, so only with the
    fast path built, and not with RINGLET_SPLIT=0: split.py), the same for one its
    receiver reduces (split_reduce_min), a point-to-point send's zero_copy_min and cma_min
    (``p2p_zero_copy_min``, ``p2p_cma_min``: up to them a blocking send completes without
    its receiver; its messages go whole, never in pieces), largest message of a C call
    (0: no fast path here). ``fast_path``: whether C runs calls here (``fast.enabled()``)."""
    on = fast_path and os.environ.get("RINGLET_SPLIT", "1") != "0"
    split, split_reduce = (SPLIT_MIN, SPLIT_REDUCE_MIN) if on else (-1, -1)
    return {"shm": {"eager": SHM_EAGER_BYTES, "rendezvous": SHM_STREAM_BYTES,
                    "piece": SHM_PIECE_BYTES,
                    "ring_bytes": RING_BYTES, "zero_copy_min": ZERO_COPY_MIN,
                    "zero_copy_oneway_min": ZERO_COPY_ONEWAY_MIN,
                    "cma_min": CMA_MIN, "cma_put_min": CMA_PUT_MIN, "split_min": split,
                    "split_reduce_min": split_reduce,
                    "p2p_zero_copy_min": ZERO_COPY_P2P_MIN, "p2p_cma_min": SHM_STREAM_BYTES,
                    "fast_bytes": FAST_BYTES if fast_path else 0},
            "tcp": {"eager": TCP_EAGER_BYTES, "rendezvous": TCP_EAGER_BYTES, "piece": 0,
                    "ring_bytes": TCP_FRAG_BYTES, "zero_copy_min": -1,
                    "zero_copy_oneway_min": -1, "cma_min": -1,
                    "cma_put_min": -1, "split_min": -1, "split_reduce_min": -1,
                    "p2p_zero_copy_min": -1, "p2p_cma_min": -1, "fast_bytes": 0}}


def affinity() -> list:
    """The CPUs this process may run on: the engine counts its job's on this machine
    (crowded or not), and the default profile prices on them."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))


def cpu_ranges(cpus) -> list:
    """CPUs as [first, last] runs: what a rank publishes of its affinity when the job forms
    (a few numbers, not one per core of a large node)."""
    runs: list = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return runs


def cpu_set(runs) -> set:
    """The CPUs of :func:`cpu_ranges`' runs."""
    return {c for first, last in runs for c in range(first, last + 1)}


def pieces(count: int, itemsize: int, p: int, piece: int | None = None,
           eager: int = SHM_EAGER_BYTES) -> int:
    """Elements per packet of a collective's message of ``count`` elements to a local peer,
    in a group of ``p`` ranks: 0 if it goes whole, else ceil(bytes / ``piece``) packets, at
    most SHM_PIECES (so pieces of ``piece`` bytes up to 4 of them, a quarter of the message
    above; SHM_PIECE_BYTES, the cost model passes its own ``piece``), for messages of more
    than two pieces, up to ``eager`` (the direction's eager limit: a smaller ring lowers it).
    The runtime splits its plans by it and the model its messages, so both count the same
    packets. Not in groups of more than PIECES_MAX_RANKS: a round's receives (up to p - 1,
    each in up to SHM_PIECES packets) must stay within what one C call tracks
    (fast.MAX_RECVS, 62)."""
    piece = SHM_PIECE_BYTES if piece is None else piece
    nbytes = count * itemsize
    if piece <= 0 or p > PIECES_MAX_RANKS or not 2 * piece < nbytes <= eager:
        return 0
    k = min(SHM_PIECES, -(-nbytes // piece))
    return -(-count // k)
