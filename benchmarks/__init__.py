"""specserve's own measurement harnesses: what docs/BENCHMARKS.md, docs/RELIABILITY.md and the GPU check
measured, kept in the repository beside the package (as vLLM and SGLang keep theirs), not in the wheel.

Run from the repository root with specserve installed (``.venv/bin/python -m benchmarks.<name> --help``):

* ``python -m benchmarks.exact_cost [--stock-lib DIR]``: exact vs fast mode (and a stock llama.cpp build)
  per decode call size, every arm a fresh process (was ``specserve bench --in-process --exact-cost``);
* ``python -m benchmarks.llama_bench --vs-llama-bench PATH``: plain decoding against llama.cpp's own
  ``llama-bench``, rounds interleaved (was ``specserve bench --in-process --vs-llama-bench PATH``);
* ``python -m benchmarks.fresh_generate [--paired]``: plain vs the default policy, every run a fresh process
  (was ``specserve bench --in-process --fresh-process [--paired]``); ``benchmarks.fresh_pair`` is the
  process it starts per round with ``--paired``;
* ``python -m benchmarks.grammar_cost``: the grammar engine's cost per token (was ``specserve bench
  --in-process --grammar-cost``);
* ``python -m benchmarks.gpu_check --output-dir DIR``: the GPU check of the torch runtime (through
  ``scripts/gpu-check.sh``);
* ``python -m benchmarks.load --url URL``: the misbehaving-clients load campaign (``scripts/reliability.sh``);
* ``python -m benchmarks.soak``: one server under load for an hour, for leaks;
* ``python -m benchmarks.suffix_cost`` (or ``python benchmarks/suffix_cost.py``): the suffix drafter's cost;
* ``python -m benchmarks.agent_replay --report R --costs C``: an agent bench's plain answers replayed through
  a model-free drafter and the cost policy on a fixed cost table (noise-free; a copy oracle as the bound);
  ``python -m benchmarks.agent_replay_waves --report R --costs C --concurrency 4``: the same, the traces
  decoding side by side in waves as the bench sends them, every step priced as llama.cpp's passes;
  ``python -m benchmarks.agent_replay_policy --report R --costs C [--proof-ramp R] [--trace KIND]``: the
  same replay under a variant of the cost policy, or with every draft of one trace kind listed;
* ``python -m benchmarks.depth_cost``: a target pass of n rows after d cached tokens, beside the cost table;
* ``python -m benchmarks.step_log_pricing --costs C LOG…``: a served run's step log (``--step-log``) replayed
  through the cost table as the engine refines it: measured / priced per band of verified rows.

The engine measurements take the flags they took under ``specserve bench`` (``--output-dir``, ``--repeats``,
``--config`` and the engine settings' flags: ``--target``, ``--threads``, ``--exact`` …). This package may
import specserve; specserve never imports it (tests/test_architecture.py).
"""
