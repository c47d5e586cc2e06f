"""``ringlet draw``: text and pictures made from the schedule the runtime executes."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import matplotlib.image
import pytest

import ringlet as rl
from ringlet import algorithms, draw
from ringlet.cli import main as cli
from ringlet.cost.model import TIERS

ALL = [(c, a) for c, table in algorithms.CATALOG.items() if c != "all_to_all_single"
       for a in table]


def _schedule(coll, algo, p=4, count=8, hosts=None):
    return algorithms.build(coll, algo, p, count, hosts=hosts)


@pytest.mark.parametrize("coll,algo", ALL)
def test_text_shows_every_message_of_every_algorithm(coll, algo):
    s = _schedule(coll, algo, p=5)
    d = draw.prepare(s, TIERS["infiniband"])
    out = draw.text(d, width=10_000)
    arrows = re.findall(r"->(\d+) (\S+?)(?:,|\s|$)", out)
    assert len(arrows) == s.messages
    # each message appears in the sender's lane with its receiver and copy/reduce mark
    lanes = {int(m.group(1)): m.group(2) for m in re.finditer(r"^rank (\d+)(.*)$", out, re.M)}
    for rnd_i, rnd in enumerate(s.rounds):
        for t in rnd:
            if not t.local:
                assert f"->{t.dst} {d.label(t)}" in lanes[t.src]
                assert d.label(t).endswith("+") == (t.op == "reduce") or t.n == 0
    assert len(d.round_times) == len(s.rounds) and all(t >= 0 for t in d.round_times)


def test_ring_labels_are_the_textbook_chunks():
    s = rl.schedule("all_reduce", p=4, count=8, algorithm="ring")
    d = draw.prepare(s, TIERS["nvlink"])
    first = [d.label(t) for t in s.rounds[0]]
    assert sorted(first) == ["c0+", "c1+", "c2+", "c3+"]
    last = [d.label(t) for t in s.rounds[-1]]
    assert all(not x.endswith("+") for x in last)


def test_round_times_are_the_cost_model_of_each_round():
    link = TIERS["ethernet"]
    s = rl.schedule("all_reduce", p=4, count=1 << 20, algorithm="ring")
    d = draw.prepare(s, link)
    chunk = (1 << 20) // 4 * 4
    # a ring round: every rank sends one chunk and receives one, at alpha + n*beta
    assert d.round_times[-1] == pytest.approx(link.alpha + chunk * link.beta, rel=1e-9)
    assert d.total == pytest.approx(rl.cost.simulate(s, link=link).time)


def test_text_wraps_rounds_to_the_width():
    s = rl.schedule("all_reduce", p=8, count=64, algorithm="ring")
    out = draw.text(draw.prepare(s, TIERS["pcie"]), width=60)
    assert max(len(line) for line in out.splitlines()) <= 60
    assert out.count("rank 7 ") >= 3       # 14 rounds in several bands
    assert "round 13" in out


def test_hosts_are_bands_and_subgroups_keep_world_names(capsys):
    assert cli(["draw", "all_reduce", "-n", "8", "--algo", "hierarchical", "--hosts", "2",
                "--tier", "infiniband", "--width", "400"]) == 0
    out = capsys.readouterr().out
    assert "rank 4 (host 1)" in out and re.search(r"^-{20,}$", out, re.M)
    assert cli(["draw", "broadcast", "--ranks", "1,3,5,7", "--algo", "binomial"]) == 0
    out = capsys.readouterr().out
    lanes = re.findall(r"^rank (\d+)", out, re.M)
    assert lanes == ["1", "3", "5", "7"]
    assert "->5 c0" in out                 # root (world rank 1) sends to group rank 2


def test_no_algorithm_draws_what_auto_would_run(capsys):
    from ringlet.cost import choose
    for coll, n in (("all_to_all", 4), ("all_reduce", 8), ("broadcast", 5)):
        assert cli(["draw", coll, "-n", str(n), "--size", "64K", "--tier", "pcie"]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        want = choose(coll, 64 << 10, n, topology=TIERS["pcie"])[0]
        assert first.startswith(f"{coll} / {want}: {n} ranks, ")
    assert cli(["draw", "all_gather", "-n", "4", "--hosts", "2"]) == 0
    assert "all_gather / " in capsys.readouterr().out


def test_a_drawing_on_this_host_says_which_model_priced_it(capsys, tmp_path, monkeypatch):
    """Tests run without a calibration (conftest): the drawing names the default model,
    and a calibrated profile's once there is one."""
    assert cli(["draw", "scatter", "-n", "4", "--size", "8M"]) == 0
    head = " ".join(capsys.readouterr().out.split("\n")[:2])
    assert head.startswith("scatter / ") and "this host's default model (uncalibrated)" in head
    from ringlet.cost.profile import default_profile
    monkeypatch.setenv("RINGLET_PROFILE", str(default_profile().save(tmp_path / "p.json")))
    assert cli(["draw", "scatter", "-n", "4", "--size", "8M"]) == 0
    head = " ".join(capsys.readouterr().out.split("\n")[:2])
    assert "this host's calibrated model" in head


def test_messages_of_no_bytes_are_syncs(tmp_path, capsys):
    assert cli(["draw", "broadcast", "-n", "4", "--algo", "binomial", "--width", "200"]) == 0
    out = capsys.readouterr().out
    assert "1 MiB buffer" in out and "->1 sync" in out and "round time" in out
    svg = tmp_path / "b.svg"
    assert cli(["draw", "broadcast", "-n", "4", "--algo", "binomial", "-o", str(svg)]) == 0
    assert "sync: no bytes" in svg.read_text()


def test_the_legend_names_only_what_is_drawn(tmp_path):
    """A broadcast reduces nothing: its legend had "reduce (cN+)" all the same; its round
    posted early, "(with 0)", is said in the title."""
    svg = tmp_path / "b.svg"
    assert cli(["draw", "broadcast", "-n", "4", "--algo", "binomial", "-o", str(svg)]) == 0
    text = svg.read_text()
    assert "copy (cN)" in text and "reduce (cN+)" not in text and "local copy" not in text
    assert "round 2 (with 0)" in text and "posted with round 0" in text
    assert cli(["draw", "all_reduce", "-n", "4", "--algo", "ring", "-o", str(svg)]) == 0
    text = svg.read_text()
    assert "reduce (cN+)" in text and "copy (cN)" in text and "posted with round 0" not in text


def test_a_round_of_data_and_syncs_labels_its_data(tmp_path):
    """A direct gather's last round carries its three blocks and the agreement's three
    syncs: past one message per rank it had labelled none. The data's labels stay."""
    svg = tmp_path / "g.svg"
    assert cli(["draw", "gather", "-n", "4", "--algo", "direct", "-o", str(svg)]) == 0
    assert svg.read_text().count("<!-- c0 -->") == 3


def test_bad_input_is_an_error_not_a_traceback(capsys):
    assert cli(["draw", "all_reduce", "--algo", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert cli(["draw", "all_reduce", "-n", "6", "--hosts", "4"]) == 2
    assert "divide" in capsys.readouterr().err
    assert cli(["draw", "all_reduce", "--itemsize", "0"]) == 2    # (a ZeroDivisionError)
    assert "--itemsize must be >= 1" in capsys.readouterr().err


def test_a_size_of_no_whole_elements_is_said_not_rounded_unsaid(capsys):
    """--size 10 of 4-byte elements drew an 8 B buffer and said nothing."""
    assert cli(["draw", "all_reduce", "-n", "3", "--size", "10"]) == 0
    out = capsys.readouterr()
    assert "--size 10 is drawn as 8 B" in out.err and "8 B buffer" in out.out
    assert cli(["draw", "all_gather", "-n", "3", "--size", "24"]) == 0
    assert "note" not in capsys.readouterr().err          # (3 blocks of 2 elements)
    assert cli(["draw", "all_gather", "-n", "3", "--size", "16"]) == 0
    assert "multiples of 12 B (4 B elements per block)" in capsys.readouterr().err


@pytest.mark.parametrize("coll,algo,extra", [
    ("all_reduce", "ring", []), ("all_reduce", "hierarchical", ["--hosts", "2", "-n", "8"]),
    ("all_to_all", "bruck", []), ("barrier", "dissemination", [])])
def test_png_is_a_real_image(tmp_path, coll, algo, extra):
    out = tmp_path / "s.png"
    assert cli(["draw", coll, "--algo", algo, "-o", str(out), *extra]) == 0
    img = matplotlib.image.imread(out)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400
    assert img[..., :3].std() > 0.05           # not a blank canvas


def test_svg_has_an_arrow_per_message(tmp_path):
    out = tmp_path / "ring.svg"
    assert cli(["draw", "all_reduce", "-n", "4", "--algo", "ring", "-o", str(out)]) == 0
    root = ET.parse(out).getroot()
    assert root.tag.endswith("svg")
    text = out.read_text()
    assert text.count("c0+") >= 1 and "round 5" in text


def test_no_help_or_output_cites_the_textbook_bare(capsys):
    """A user has not read the book: numbers are said in words; a reference may only be a
    footnote ("[1] Output 4.1.1 of ...")."""
    bare = re.compile(r"seed \d{3}|(?<!\[1\] )(Output|Exercise|Table) \d+\.\d+\.\d+")
    for argv in (["plan", "-h"], ["tiers", "-h"], ["explain", "-h"], ["calibrate", "-h"],
                 ["bench", "-h"], ["run", "-h"], ["draw", "-h"], ["trace", "-h"], ["plan"],
                 ["plan", "--models"], ["plan", "-b", "32", "--alpha", "1e-6"],
                 ["tiers", "--sweep"], ["--help"]):
        try:
            cli(argv)
        except SystemExit:
            pass
        out = capsys.readouterr()
        text = out.out + out.err
        assert text.strip(), argv
        assert not bare.search(text), (argv, bare.search(text).group(0))


def test_no_python_help_cites_the_textbook_bare():
    """help() on ringlet's modules is help text too."""
    import importlib
    import inspect
    import pkgutil
    bare = re.compile(r"seed \d{3}|(?<!\[1\] )(Output|Exercise|Table|Code|Figure) \d+\.\d+\.\d+",
                      re.I)
    names = ["ringlet"] + [m.name for m in pkgutil.walk_packages(rl.__path__, "ringlet.")]
    for name in names:
        mod = importlib.import_module(name)
        docs = [(name, inspect.getdoc(mod) or "")]
        for attr, obj in vars(mod).items():
            if not attr.startswith("_") and getattr(obj, "__module__", None) == name:
                docs.append((f"{name}.{attr}", inspect.getdoc(obj) or ""))
        for where, doc in docs:
            assert not bare.search(doc), (where, bare.search(doc).group(0))


@pytest.mark.parametrize("args, says", [
    (["draw", "all_reduce", "-n", "8", "--algo", "hierarchical"], "say how many with --hosts"),
    (["draw", "all_reduce", "--ranks", "a,b"], "--ranks takes comma-separated world ranks"),
    (["draw", "all_reduce", "-n", "1"], "must be >= 2"),
    (["draw", "all_reduce", "-n", "8", "--hosts", "3"], "e.g. --hosts 3,3,2"),
    (["draw", "all_reduce", "-n", "8", "--hosts", "3,3"], "add up to the 8 ranks"),
    (["explain", "all_reduce", "-n", "8", "--hosts", "3"], "e.g. --hosts 3,3,2"),
    (["explain", "all_reduce", "-n", "8", "--hosts", "x"], "give a number of hosts"),
])
def test_draw_refuses_what_it_cannot_draw_saying_why(args, says, capsys):
    """hierarchical without --hosts drew the flat ring under its name; --ranks a,b said
    "invalid literal for int()"."""
    assert cli(args) == 2
    assert says in capsys.readouterr().err


def test_hosts_of_other_sizes_are_given_by_size(capsys):
    """The README says hosts may differ in size; explain and draw took a count only
    ("--hosts 3 must divide -n 8")."""
    assert cli(["explain", "all_reduce", "-n", "8", "--hosts", "3,3,2", "--size", "64M",
                "--tier", "infiniband"]) == 0
    out = capsys.readouterr().out
    assert "3 hosts of 3,3,2 ranks" in out and "hierarchical" in out
    assert cli(["draw", "all_reduce", "-n", "8", "--algo", "hierarchical", "--hosts", "3,3,2",
                "--tier", "infiniband"]) == 0
    out = capsys.readouterr().out
    assert "on 3\nhosts" in out or "on 3 hosts" in out
    assert "rank 7 (host 2)" in out and "rank 5 (host 1)" in out


def test_text_shows_a_rounds_local_reduces(capsys):
    """Recursive doubling's last round only reduces what came in: its cells read '.', as
    if the round did nothing, though it is priced."""
    assert cli(["draw", "all_reduce", "-n", "4", "--algo", "recursive_doubling",
                "--width", "200"]) == 0
    last = [line.split()[-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("rank ")]
    assert len(last) == 4 and all(c.endswith("+") for c in last), last


def test_a_rooted_drawing_names_its_root_as_its_lanes_do(capsys):
    """--root is a place in the group; with --ranks the lanes are world ranks, and nothing
    said the data left world rank 7 for --root 3."""
    assert cli(["draw", "broadcast", "--ranks", "1,3,5,7", "--algo", "binomial",
                "--root", "3"]) == 0
    assert "root rank 7," in capsys.readouterr().out


def test_an_empty_call_is_not_drawn_as_syncs(capsys):
    """all_reduce --size 0: its 24 empty chunks were labelled and coloured as syncs, the
    agreement of rooted calls."""
    assert cli(["draw", "all_reduce", "-n", "4", "--size", "0", "--algo", "ring",
                "--width", "200"]) == 0
    assert "sync" not in capsys.readouterr().out.split("a cell:")[-1].split("round time:")[-1]
