"""The replication runner (issue 16, ``configs/bench/replication-*.yaml``): entry kinds for runs that span
short device calls, and the claims' reports.

A device call lasts at most 10 minutes and starts on a bare machine; only up to 8 files (16 MiB each) come
back from ``$OUT``, and the next call gets back what the caller carries. The suites therefore keep every run
under one state folder, ``root`` (default ``runs/replication``, one sub-folder per run: ``essh``,
``dense``, ...), and three kinds move it through calls:

=====================  ======================================================================================
``replication_step``   one command of a run (``elastic-ssm train ... --resume auto``, ``eval``, ``recover``):
                       skipped when its ``outputs`` (or everything in ``skip_when``) exist, ``waiting`` while a
                       path of ``requires`` is missing, ``deferred`` when less than ``needs_s`` of the suite's
                       budget is left (or, for a run starting over because its checkpoint did not travel, less
                       than a cut fresh attempt of it ran plus ``grace_s``: it needs more than it had); a
                       command still running ``grace_s`` before the budget ends gets SIGTERM
                       (``elastic-ssm train`` then writes a checkpoint and exits 143) and SIGKILL at the end.
                       Output is appended to ``<run>/logs/<entry>.log``, one JSON line per call (state, rc,
                       seconds, whether a checkpoint existed at the start, device, commit) to
                       ``<run>/calls.jsonl``; with ``once`` a step that ran to completion in an earlier call
                       is skipped although its outputs (model weights) did not travel (the calibration probes).
                       With ``concurrent`` the command starts and the suite goes on at once (a thread supervises
                       it), so two small runs share the GPU; the next ``replication_report`` or
                       ``replication_state`` entry first waits for every such step (``wait_concurrent``).
``replication_state``  ``action: wait`` waits for the concurrent steps started so far (a later step needs their
                       outputs); ``action: restore`` unpacks the state carried from the last call (``carry``
                       folder) into ``root`` unless the machine still holds that generation or a newer one, then
                       adds the committed records (``records``, below) of runs the state lacks; ``action: pack``
                       writes ``root`` as ``replication-state.tgz.partNN`` (at most ``part_mib`` each) plus
                       ``replication-state.json`` into ``dest`` (``$OUT``), leaving out model weights and
                       checkpoints except the newest checkpoint of an unfinished run when the whole state
                       stays under ``max_mib``; and copies the files named in ``publish`` beside them. The
                       steps' ``TRITON_CACHE_DIR`` is ``<root>/.triton``: its autotuning results travel too,
                       so fla's kernels are benchmarked once per shape over all calls, not once per call.
                       Pack also writes ``replication-records.tgz``: each run's records (``RECORD_FILES`` and its
                       logs, text, what the reports read) and the Triton autotuning results (``.triton``), to be
                       unpacked into ``docs/results/records/`` and
                       committed, so a finished run survives the loss of the carried state (the carry lives on
                       one development machine; committed records live in the repository).
``replication_report`` the per-tier numbers of every run of one claim into ``<root>/results/claimN.json`` and
                       its plot ``claimN.png`` (``claims.py``, ``plot.py``).
=====================  ======================================================================================

In the command of a step ``{root}`` is the state folder, ``{run}`` the run's folder (``<root>/<run>``) and
``python`` this interpreter.

Modules: ``steps.py`` (``replication_step``: running a step within the device-time budget, SIGTERM before it
ends), ``state.py`` (``replication_state``: packing, restoring and the committed records), ``report.py``
(``replication_report``), ``claims.py`` (the per-tier numbers of a claim from its runs; also read by
``benchmarks/results_page.py``) and ``plot.py`` (a claim's plot). They live outside the installed package; the
suites run them from the repository root (``benchmarks/kinds.py`` imports them by name).
"""
