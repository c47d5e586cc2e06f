"""ringlet.cost: price a collective before you launch it.

* :mod:`.model` - links, the interconnect tiers, closed forms for every (collective, algorithm)
  and the size convention;
* :mod:`.simulate` - price the very Schedule the runtime runs on a hosts x ranks topology;
* :mod:`.host` - ``HostModel``: how the ranks of one host spend time (the calibrated terms);
* :mod:`.plan` - the communication-to-computation ratio gamma and break-even K;
* :mod:`.profile` - this host's calibrated alpha/beta/gamma, and the least-squares fit;
* :mod:`.tune` - ``breakdown`` / ``predict`` (on a link, a topology or this host) and
  ``choose``: the least predicted time, explained;
* :mod:`.place` - ``place``: which host each rank of a job should run on.
(The `ringlet plan`, `tiers`, `explain`, `place` and `calibrate` commands are tools above
it: ringlet/commands.py, ringlet/calibrate.py.)
"""
from .model import (ALGORITHMS, COLLECTIVES, TIERS, Link, Terms, count_of, format_size,
                    nbytes_of, parse_size, tier)
from .plan import StepRatio, break_even, step_ratio, strong_scaling, weak_scaling
from .profile import Profile, fit, host_link, load_profile, profile_path
from .simulate import SimResult, Topology, simulate
from .tune import (Row, breakdown, choose, crossovers, predict, predict_host, predict_p2p,
                   reduce_gamma)
from .place import Comm, Placement, expert_parallel, place, tensor_data_parallel  # noqa: E402

__all__ = ["Link", "TIERS", "tier", "Terms", "ALGORITHMS", "COLLECTIVES", "predict", "breakdown",
           "nbytes_of", "count_of", "parse_size", "format_size",
           "Topology", "SimResult", "simulate",
           "StepRatio", "step_ratio", "strong_scaling", "weak_scaling", "break_even",
           "Profile", "load_profile", "host_link", "profile_path", "fit",
           "choose", "Row", "crossovers", "predict_host", "predict_p2p", "reduce_gamma",
           "place", "Comm", "Placement", "tensor_data_parallel", "expert_parallel"]
