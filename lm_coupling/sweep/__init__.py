"""``lm-coupling sweep``: many models or checkpoints through one evaluation, then the report.

- `lm_coupling.sweep.spec`: MODELS (files, comma lists, brace ranges) to entries;
- `lm_coupling.sweep.plan`: sharding and what a rerun still has to run;
- `lm_coupling.sweep.runner`: one model's ``lm-coupling run`` process;
- `lm_coupling.sweep.status`: the per-model records (``sweep_status.csv``);
- `lm_coupling.sweep.progress`: the sweep's progress lines;
- `lm_coupling.sweep.study`: named studies (``--study``; shipped in ``studies/*.json``);
- `lm_coupling.sweep.calibrate`: a shape's forward and Jacobian seconds on the device;
- `lm_coupling.sweep.estimate`: ``--plan`` and ``--max-hours``;
- `lm_coupling.sweep.command`: the command itself.
"""
