"""ringlet.train: the training patterns that call for each collective, on ringlet's.

One module per pattern, each able to price its step before it runs (``.price(topology)``)
and measured with ``rl.profile()``:

* :mod:`.buckets`  - data parallel: gradient buckets, async all_reduce as each fills;
* :mod:`.zero`     - ZeRO stages 1, 2, 3: reduce-scatter and all-gather around a sharded
  optimizer;
* :mod:`.moe`      - mixture-of-experts routing: dispatch / combine by uneven all_to_all;
* :mod:`.tensor`   - Megatron's column- and row-parallel linear layers;
* :mod:`.pipeline` - pipeline stages over micro-batches, GPipe and 1F1B, by isend/irecv;
* :mod:`.ps`       - parameter server / actor-learner, synchronous or bounded-staleness;
* :mod:`.pricing`  - a step's calls priced on a topology, and its gamma
  (communication over computation time);
* :mod:`.memory`   - the bytes a rank holds, measured (``measure_memory``).
"""
from .buckets import GradBuckets
from .memory import measure_memory
from .moe import Routing, combine, dispatch
from .optim import SGD, Adam
from .pipeline import Pipeline
from .ps import ParameterServer
from .pricing import Call, StepPrice, compute_seconds, measure_flop_rate, price
from .tensor import ColumnParallelLinear, RowParallelLinear
from .zero import ZeroOptimizer

__all__ = ["GradBuckets", "ZeroOptimizer", "dispatch", "combine", "Routing", "SGD", "Adam",
           "ColumnParallelLinear", "RowParallelLinear", "Pipeline", "ParameterServer",
           "Call", "StepPrice", "price", "compute_seconds", "measure_flop_rate", "measure_memory"]
