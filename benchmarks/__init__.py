"""The research harness beside the library (not installed with ``elastic_ssm``; run from the repository root).

Suite kinds (``elastic_ssm/bench/kinds.py`` loads them by name for ``elastic-ssm bench --bench.suite``):
``replication/`` (issue 16's runner across device calls: steps within the device-time budget, the carried state, the
claims' reports and plots), ``multigpu.py`` (torchrun training matrices), ``profiling.py``, ``gemv_sweep.py``,
``scan_timing.py``, ``checksum.py``, ``es_ssm_report.py``, ``first_token.py``, ``generate_paths.py`` and
``tests_kind.py``. Commands: ``python -m benchmarks.results_page`` (docs/results.md against the committed records),
``python -m benchmarks.ddp_check`` (DDP against one device) and ``python -m benchmarks.serve_proxy`` (the serve bench
against a stub engine on the CPU; ``serve_stub.py`` its server). ``fla_peers.py``: the fla peers of ``elastic-ssm
bench``.
"""
