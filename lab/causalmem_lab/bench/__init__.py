"""``causalmem bench``: benchmarks of the real code paths.

- ``throughput``: raw aiokafka consumption vs the pipeline end to end (worker + learner
  processes on the same broker), and the learner's update vs a bare torch step;
- ``learning``: what each policy learns on a scenario with known ground truth;
- ``soak``: a steady input rate for a set time, with lag and memory sampled;
- ``evaluator``: evaluations/s and tokens/s of the evaluator's LM scoring, and of the service.
- ``gate``: whether the promotion rule's intervals hold on the real-data world (coverage at every look,
  false promotions and refusals).
- ``coldstart``: learner steps a new helpful memory needs to enter the served top-k, kNN vs fresh rows.
- ``scale``: the learner's step rate and RSS, and retrieval latency with the policy against plain
  faiss, at S = 1,024, 100,000 and 1,000,000 memories.
- ``freshness``: seconds from a pair's publication to a serving checkpoint covering it loaded by a
  client, at the previous and the current checkpoint defaults (worker, learner, client on a broker).
- ``promise``: on the real-data world, in process, whether any version the gate served was worse
  than similarity-only by more than ε (the unsafe share over runs), and what it learnt.
- ``guardrail``: on the real-data world, in process, the decisions until the guardrail rolls back
  a version served at once that is worse than similarity-only.
- ``serving``: the latency a request pays for the product: ``CausalRetriever.retrieve`` against its
  faiss search, the LangChain adapter against the store's own retriever, and the adapter with a
  publisher while the broker is up, stopped, flapping or refusing.
- ``poisoning``: a principal reporting inverted utilities at 6, 12 and 25% of the traffic (spread,
  or on one intent): the honest clients' harmful-read rate against the honest-only run, with and
  without the learner's per-principal defences (contract 1.15), and whether the liar is flagged.

Figures are ratios measured side by side in one run, since absolute times on shared
machines vary; ``docs/benchmarks.md`` records the latest ones with their commands.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCHES = {
    "throughput": "causalmem_lab.bench.throughput",
    "learning": "causalmem_lab.bench.learning",
    "soak": "causalmem_lab.bench.soak",
    "evaluator": "causalmem_lab.bench.evaluator",
    "gate": "causalmem_lab.bench.gate_calibration",
    "coldstart": "causalmem_lab.bench.coldstart",
    "scale": "causalmem_lab.bench.scale",
    "freshness": "causalmem_lab.bench.freshness",
    "promise": "causalmem_lab.bench.promise",
    "guardrail": "causalmem_lab.bench.guardrail",
    "serving": "causalmem_lab.bench.serving",
    "poisoning": "causalmem_lab.bench.poisoning",
}


def finish(report: dict[str, Any], table: Callable[[dict[str, Any]], str], out: str | None) -> int:
    """How a bench ends: its table printed and, where ``--out`` names a file, its report written
    there as JSON. Returns the exit status (0)."""
    print(table(report))
    if out:
        Path(out).write_text(json.dumps(report, indent=1))
    return 0
