"""A training run of a converted model's heads: what trains (trainable), the run's --out folder and
its record (run_folder), Trainer checkpoints and resume (checkpoints), progress and stop signals
(monitor), FSDP (sharding), figures (plots), what a finished run reports and saves (result), and the job
that ties them (job)."""
