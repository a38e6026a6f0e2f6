"""The research harness beside the library (not installed with ``elastic_ssm``; run from the repository root).

Suites: ``elastic-ssm bench --bench.suite`` loads ``suite.py`` (``configs/bench/*.yaml`` -> typed entries, time
budget, ``run_suite``) through ``elastic_ssm.bench.harness_module``; ``targets.py`` (targets as data),
``suite_report.py`` (a run's tables) and ``kinds.py`` (the registry of entry kinds, loaded by name; the ``command``
kind) beside it. Suite kinds:
``replication/`` (issue 16's runner across device calls: steps within the device-time budget, the carried state, the
claims' reports and plots), ``multigpu.py`` (torchrun training matrices), ``profiling.py``, ``gemv_sweep.py``,
``scan_timing.py``, ``checksum.py``, ``memory.py`` (decode caches per tier, Table 53), ``es_ssm_decode.py``,
``es_ssm_report.py``, ``first_token.py``, ``generate_paths.py`` and ``tests_kind.py``. Commands: ``python -m
benchmarks.results_page`` (docs/results.md against the committed records), ``python -m benchmarks.ddp_check`` (DDP
against one device) and ``python -m benchmarks.serve_proxy`` (the serve bench against a stub engine on the CPU;
``serve_stub.py`` its server). ``fla_peers.py``: the fla peers of ``elastic-ssm bench``.
"""
